//go:build linux

package microvm

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

// fakeModuleTree writes a lib/modules/<v> tree whose modules are tiny
// ELF-less files, with dependencies given by modules.dep.
func fakeModuleTree(t *testing.T, dep string, builtin []string, files ...string) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range files {
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if dep != "" {
		if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte(strings.Join(builtin, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func rel(dir string, paths []string) []string {
	var out []string
	for _, p := range paths {
		r, _ := filepath.Rel(dir, p)
		out = append(out, r)
	}
	return out
}

// The order the archive's 6.1.0-57 kernel needs: virtio depends on
// virtio_ring (the old hard-coded order loaded virtio first and failed).
func TestResolveModulesFromModulesDep(t *testing.T) {
	dep := "kernel/drivers/virtio/virtio_ring.ko:\n" +
		"kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n" +
		"kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n" +
		"kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n" +
		"kernel/drivers/firmware/qemu_fw_cfg.ko:\n" +
		"kernel/net/core/failover.ko:\n" +
		"kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko\n" +
		"kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n"
	dir := fakeModuleTree(t, dep, nil, "kernel/drivers/virtio/virtio_ring.ko", "kernel/drivers/virtio/virtio.ko",
		"kernel/drivers/virtio/virtio_mmio.ko", "kernel/drivers/char/virtio_console.ko", "kernel/drivers/firmware/qemu_fw_cfg.ko",
		"kernel/net/core/failover.ko", "kernel/drivers/net/net_failover.ko", "kernel/drivers/net/virtio_net.ko")
	got, err := resolveModules(dir, guestDrivers)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"kernel/drivers/virtio/virtio_ring.ko", "kernel/drivers/virtio/virtio.ko",
		"kernel/drivers/virtio/virtio_mmio.ko", "kernel/drivers/char/virtio_console.ko", "kernel/drivers/firmware/qemu_fw_cfg.ko",
		"kernel/net/core/failover.ko", "kernel/drivers/net/net_failover.ko", "kernel/drivers/net/virtio_net.ko"}
	if r := rel(dir, got); !reflect.DeepEqual(r, want) {
		t.Fatalf("order = %v, want %v", r, want)
	}
}

func TestResolveModulesBuiltinAndErrors(t *testing.T) {
	dep := "kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko\n" +
		"kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko\n" +
		"kernel/drivers/firmware/qemu_fw_cfg.ko:\n" +
		"kernel/drivers/net/virtio_net.ko: kernel/drivers/virtio/virtio.ko\n"
	// virtio built in: only the four drivers are loaded.
	dir := fakeModuleTree(t, dep, []string{"kernel/drivers/virtio/virtio.ko"},
		"kernel/drivers/virtio/virtio_mmio.ko", "kernel/drivers/char/virtio_console.ko", "kernel/drivers/firmware/qemu_fw_cfg.ko",
		"kernel/drivers/net/virtio_net.ko")
	got, err := resolveModules(dir, guestDrivers)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 4 {
		t.Fatalf("got %v, want the four drivers", rel(dir, got))
	}

	// A dependency that exists nowhere is named.
	dir = fakeModuleTree(t, dep, nil,
		"kernel/drivers/virtio/virtio_mmio.ko", "kernel/drivers/char/virtio_console.ko", "kernel/drivers/firmware/qemu_fw_cfg.ko",
		"kernel/drivers/net/virtio_net.ko")
	if _, err := resolveModules(dir, guestDrivers); err == nil || !strings.Contains(err.Error(), "virtio ") {
		t.Fatalf("missing dependency: err = %v", err)
	}
	// A compressed module is refused clearly.
	dir = fakeModuleTree(t, dep, []string{"kernel/drivers/virtio/virtio.ko"},
		"kernel/drivers/virtio/virtio_mmio.ko.xz", "kernel/drivers/char/virtio_console.ko", "kernel/drivers/firmware/qemu_fw_cfg.ko",
		"kernel/drivers/net/virtio_net.ko")
	if _, err := resolveModules(dir, guestDrivers); err == nil || !strings.Contains(err.Error(), "compressed") {
		t.Fatalf("compressed module: err = %v", err)
	}
	// A cycle is an error, not a hang.
	cyc := "kernel/a.ko: kernel/b.ko\nkernel/b.ko: kernel/a.ko\n"
	dir = fakeModuleTree(t, cyc, nil, "kernel/a.ko", "kernel/b.ko")
	if _, err := resolveModules(dir, []string{"a"}); err == nil || !strings.Contains(err.Error(), "cycle") {
		t.Fatalf("cycle: err = %v", err)
	}
	// A malformed modules.dep is an error.
	dir = fakeModuleTree(t, "garbage line\n", nil, "kernel/a.ko")
	if _, err := resolveModules(dir, []string{"a"}); err == nil {
		t.Fatal("malformed modules.dep accepted")
	}
}

func TestParseModinfoDepends(t *testing.T) {
	blob := []byte("license=GPL\x00depends=virtio_ring,virtio\x00name=virtio_mmio\x00depends=\x00vermagic=6.1\x00")
	if got, want := parseModinfoDepends(blob), []string{"virtio", "virtio_ring"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("depends = %v, want %v", got, want)
	}
	if got := parseModinfoDepends([]byte("depends=\x00")); len(got) != 0 {
		t.Fatalf("empty depends = %v", got)
	}
}

func FuzzParseModinfoDepends(f *testing.F) {
	f.Add([]byte("depends=a,b-c\x00name=x"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, d := range parseModinfoDepends(b) {
			if d == "" || strings.Contains(d, ",") || strings.Contains(d, "-") {
				t.Fatalf("bad name %q", d)
			}
		}
	})
}

// The kernel make vm-deps extracted (whatever version the archive serves
// today, no modules.dep in the package): its own modinfo gives an order in
// which every module's dependencies come before it.
func TestResolveModulesRealKernel(t *testing.T) {
	kdir := filepath.Join(repoRoot(t), ".cache", "vm", "kernel")
	if _, err := os.Stat(filepath.Join(kdir, "modules")); err != nil {
		testenv.Skipf(t, "no guest kernel modules in %s (run make vm-deps)", kdir)
	}
	mods, err := resolveModules(filepath.Join(kdir, "modules"), guestDrivers)
	if err != nil {
		t.Fatal(err)
	}
	loaded := map[string]bool{}
	for _, m := range mods {
		deps, err := modinfoDepends(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range deps {
			if !loaded[d] {
				t.Errorf("%s loaded before its dependency %s", moduleNameOf(m), d)
			}
		}
		loaded[moduleNameOf(m)] = true
	}
	for _, d := range guestDrivers {
		if !loaded[d] {
			t.Errorf("driver %s not in %v", d, mods)
		}
	}
	t.Logf("load order: %v", rel(filepath.Join(kdir, "modules"), mods))
}
