//go:build linux

package microvm

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
)

func TestWithGroupRW(t *testing.T) {
	const gid = 4242
	// Minimal ACL of a 0600 device: the owning group and others stay at
	// nothing; the mask admits rw for the new group only.
	got := withGroupRW(nil, 0o600, gid)
	want := []aclEntry{{aclUserObj, 6, aclUndefinedI}, {aclGroupObj, 0, aclUndefinedI}, {aclOther, 0, aclUndefinedI},
		{aclGroup, 6, gid}, {aclMask, 6, aclUndefinedI}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("0600: %v, want %v", got, want)
	}
	if !hasGroupRW(got, gid) || hasGroupRW(got, gid+1) {
		t.Fatal("hasGroupRW wrong")
	}
	// An existing ACL keeps its entries; an existing mask only gains rw;
	// the entry is not duplicated.
	in := []aclEntry{{aclUserObj, 6, aclUndefinedI}, {aclUser, 6, 1000}, {aclGroupObj, 6, aclUndefinedI},
		{aclMask, 4, aclUndefinedI}, {aclOther, 0, aclUndefinedI}}
	got = withGroupRW(in, 0o660, gid)
	got = withGroupRW(got, 0o660, gid)
	n := 0
	for _, e := range got {
		if e.tag == aclGroup && e.id == gid {
			n++
		}
		if e.tag == aclMask && e.perm != 6 {
			t.Errorf("mask %o, want 6", e.perm)
		}
	}
	if n != 1 || len(got) != 6 {
		t.Fatalf("entries %v", got)
	}
	// A mask that hides the group's bits is not a grant.
	if hasGroupRW([]aclEntry{{aclGroup, 6, gid}, {aclMask, 4, aclUndefinedI}}, gid) {
		t.Fatal("masked entry counted as rw")
	}
	// The wire format round-trips; truncated or other versions are errors.
	b := encodeACL(got)
	back, err := parseACL(b)
	if err != nil || !reflect.DeepEqual(back, got) {
		t.Fatalf("round trip: %v %v", back, err)
	}
	for _, bad := range [][]byte{nil, b[:7], append([]byte{3, 0, 0, 0}, b[4:]...)} {
		if _, err := parseACL(bad); err == nil {
			t.Errorf("parseACL accepted %x", bad)
		}
	}
}

// kvmHelperEnv makes the test binary, re-run under another uid, open
// /dev/kvm and create a VM instead of running tests.
const kvmHelperEnv = "SPACE_TEST_KVM_OPEN"

func TestMain(m *testing.M) {
	if os.Getenv(kvmHelperEnv) != "" {
		os.Exit(kvmOpenHelper())
	}
	if os.Getenv(starterEnv) != "" {
		os.Exit(vmStarter())
	}
	os.Exit(m.Run())
}

// kvmOpenHelper exits 0 when /dev/kvm opens and KVM_CREATE_VM succeeds,
// 13 when the open is refused, 1 on anything else.
func kvmOpenHelper() int {
	fd, err := unix.Open(kvmDevice, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) {
		return 13
	}
	if err != nil {
		return 1
	}
	const kvmCreateVM = 0xAE01
	vm, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmCreateVM, 0)
	if errno != 0 {
		return 1
	}
	unix.Close(int(vm))
	return 0
}

// QEMU's credentials (a leased uid, KVMGroup as the only supplementary
// group) open /dev/kvm and create a VM, whatever the device's mode; a uid
// of the same range without the group, and the group's neighbour, cannot.
// The device's mode and owner are unchanged.
func TestKVMAccessOnlyForQEMUCredentials(t *testing.T) {
	testenv.RequireRoot(t, "uids and /dev/kvm's ACL")
	if _, err := os.Stat(kvmDevice); err != nil {
		testenv.Skipf(t, "no %s on this host", kvmDevice)
	}
	var before unix.Stat_t
	if err := unix.Stat(kvmDevice, &before); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s := &Substrate{cfg: Config{UIDLockDir: filepath.Join(dir, "uids"), UIDFirst: DefaultUIDFirst, UIDCount: 16}.withDefaults(), asRoot: true}
	if err := grantKVM(kvmDevice, s.cfg.KVMGroup, s.cfg.UIDLockDir); err != nil {
		t.Fatal(err)
	}
	var after unix.Stat_t
	if err := unix.Stat(kvmDevice, &after); err != nil {
		t.Fatal(err)
	}
	if before.Uid != after.Uid || before.Gid != after.Gid || before.Mode&0o707 != after.Mode&0o707 {
		t.Fatalf("owner or mode changed: %d:%d %o -> %d:%d %o", before.Uid, before.Gid, before.Mode, after.Uid, after.Gid, after.Mode)
	}
	// The binary must be readable by the unprivileged uids.
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bdir, err := os.MkdirTemp("", "space-kvm-helper-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(bdir) })
	bin := filepath.Join(bdir, "helper")
	data, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(bdir, 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(cred *syscall.Credential) int {
		cmd := exec.Command(bin)
		cmd.Env = []string{kvmHelperEnv + "=1"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	}
	cred, lease, err := s.qemuCredential("kvm")
	if err != nil {
		t.Fatal(err)
	}
	defer lease.release()
	if code := run(cred); code != 0 {
		t.Fatalf("QEMU's credentials (uid %d, groups %v): exit %d, want /dev/kvm open and KVM_CREATE_VM", cred.Uid, cred.Groups, code)
	}
	tcgCred, tcgLease, err := s.qemuCredential("tcg")
	if err != nil {
		t.Fatal(err)
	}
	defer tcgLease.release()
	if len(tcgCred.Groups) != 0 {
		t.Fatalf("a TCG QEMU gets groups %v", tcgCred.Groups)
	}
	others := map[string]*syscall.Credential{
		"leased uid without the group": tcgCred,
		"other gid as group":           {Uid: cred.Uid, Gid: cred.Uid, Groups: []uint32{s.cfg.KVMGroup - 1}},
		"nobody":                       {Uid: 65534, Gid: 65534, Groups: []uint32{}},
	}
	if before.Mode&0o060 == 0 { // the device's own group had no access and must not gain it
		others["the device's own group"] = &syscall.Credential{Uid: cred.Uid, Gid: before.Gid, Groups: []uint32{before.Gid}}
	}
	for name, c := range others {
		if code := run(c); code != 13 {
			t.Errorf("%s: exit %d, want 13 (open refused)", name, code)
		}
	}
}
