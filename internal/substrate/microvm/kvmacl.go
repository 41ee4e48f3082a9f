//go:build linux

package microvm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"
)

// KVM access for QEMU's uids, whatever /dev/kvm's owner and mode: one
// named-group entry (rw) in the device's POSIX access ACL, for a group no
// account or file uses (Config.KVMGroup). Every QEMU under KVM runs with
// that group as its only supplementary group, so the group opens /dev/kvm
// and nothing else. The device's mode is never widened: the ACL mask
// admits the named group alone; the owning group's and others' bits keep
// what they had. Other ACL entries (e.g. a desktop's uaccess ones) are
// kept as they are.

const (
	aclXattr      = "system.posix_acl_access"
	aclVersion    = 2
	aclUserObj    = 0x01
	aclUser       = 0x02
	aclGroupObj   = 0x04
	aclGroup      = 0x08
	aclMask       = 0x10
	aclOther      = 0x20
	aclUndefinedI = 0xffffffff
)

type aclEntry struct {
	tag  uint16
	perm uint16
	id   uint32
}

func parseACL(b []byte) ([]aclEntry, error) {
	if len(b) < 4 || (len(b)-4)%8 != 0 {
		return nil, fmt.Errorf("acl of %d bytes", len(b))
	}
	if v := binary.LittleEndian.Uint32(b); v != aclVersion {
		return nil, fmt.Errorf("acl version %d", v)
	}
	var out []aclEntry
	for p := 4; p < len(b); p += 8 {
		out = append(out, aclEntry{
			tag:  binary.LittleEndian.Uint16(b[p:]),
			perm: binary.LittleEndian.Uint16(b[p+2:]),
			id:   binary.LittleEndian.Uint32(b[p+4:]),
		})
	}
	return out, nil
}

func encodeACL(es []aclEntry) []byte {
	sort.SliceStable(es, func(i, j int) bool {
		if es[i].tag != es[j].tag {
			return es[i].tag < es[j].tag
		}
		return es[i].id < es[j].id
	})
	b := make([]byte, 4+8*len(es))
	binary.LittleEndian.PutUint32(b, aclVersion)
	for i, e := range es {
		p := 4 + 8*i
		binary.LittleEndian.PutUint16(b[p:], e.tag)
		binary.LittleEndian.PutUint16(b[p+2:], e.perm)
		binary.LittleEndian.PutUint32(b[p+4:], e.id)
	}
	return b
}

// withGroupRW returns acl (or the minimal ACL of mode when acl is empty)
// with a rw entry for gid. The mask gains rw and nothing else: it starts
// from the existing mask (or, in a minimal ACL, the owning group's bits, so
// their effective rights stay what they were).
func withGroupRW(acl []aclEntry, mode uint32, gid uint32) []aclEntry {
	if len(acl) == 0 {
		acl = []aclEntry{
			{aclUserObj, uint16(mode >> 6 & 7), aclUndefinedI},
			{aclGroupObj, uint16(mode >> 3 & 7), aclUndefinedI},
			{aclOther, uint16(mode & 7), aclUndefinedI},
		}
	}
	var out []aclEntry
	var mask, groupObj uint16
	hasMask, found := false, false
	for _, e := range acl {
		switch e.tag {
		case aclMask:
			mask, hasMask = e.perm, true
			continue // written below
		case aclGroupObj:
			groupObj = e.perm
		case aclGroup:
			if e.id == gid {
				e.perm, found = 6, true
			}
		}
		out = append(out, e)
	}
	if !hasMask {
		mask = groupObj
	}
	if !found {
		out = append(out, aclEntry{aclGroup, 6, gid})
	}
	return append(out, aclEntry{aclMask, mask | 6, aclUndefinedI})
}

// hasGroupRW reports whether acl grants gid read and write through the
// mask.
func hasGroupRW(acl []aclEntry, gid uint32) bool {
	var grp, mask uint16 = 0, 7
	for _, e := range acl {
		switch {
		case e.tag == aclGroup && e.id == gid:
			grp = e.perm
		case e.tag == aclMask:
			mask = e.perm
		}
	}
	return grp&mask&6 == 6
}

// grantKVM makes sure dev (a character device, /dev/kvm) grants gid rw
// through its access ACL. Writers on one host serialize on an flock in
// lockDir, so two workers never lose each other's edits.
func grantKVM(dev string, gid uint32, lockDir string) error {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return fmt.Errorf("microvm: %s: %w", dev, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return fmt.Errorf("microvm: %s is not a character device", dev)
	}
	cur, err := readACL(dev)
	if err != nil {
		return err
	}
	if hasGroupRW(cur, gid) {
		return nil
	}
	if err := os.MkdirAll(lockDir, 0o700); err != nil {
		return fmt.Errorf("microvm: kvm acl lock: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(lockDir, "kvm-acl.lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("microvm: kvm acl lock: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("microvm: kvm acl lock: %w", err)
	}
	if err := unix.Stat(dev, &st); err != nil {
		return fmt.Errorf("microvm: %s: %w", dev, err)
	}
	if cur, err = readACL(dev); err != nil {
		return err
	}
	if err := unix.Setxattr(dev, aclXattr, encodeACL(withGroupRW(cur, st.Mode&0o777, gid)), 0); err != nil {
		return fmt.Errorf("microvm: grant gid %d access to %s: %w", gid, dev, err)
	}
	return nil
}

func readACL(path string) ([]aclEntry, error) {
	buf := make([]byte, 4096)
	n, err := unix.Getxattr(path, aclXattr, buf)
	switch {
	case errors.Is(err, unix.ENODATA):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("microvm: read acl of %s: %w", path, err)
	}
	es, err := parseACL(buf[:n])
	if err != nil {
		return nil, fmt.Errorf("microvm: acl of %s: %w", path, err)
	}
	return es, nil
}
