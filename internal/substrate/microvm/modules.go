//go:build linux

package microvm

import (
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// guestDrivers are the drivers the guest needs (virtio-mmio transport, the
// virtio-serial console carrying the agent's channel, fw_cfg carrying its
// environment, virtio-net for the NIC). What they depend on, and the order to load it all in, is
// read from the kernel's own modules: a kernel package moves with the
// archive's updates (6.1.0-57 made virtio.ko depend on virtio_ring), so no
// order is hard-coded here.
var guestDrivers = []string{"virtio_mmio", "virtio_console", "qemu_fw_cfg", "virtio_net"}

// diskDrivers are what an image VM's root disk needs on top of
// guestDrivers: the virtio block driver, ext4 (built into Debian's cloud
// kernel; a module elsewhere) and overlay.
var diskDrivers = []string{"virtio_blk", "ext4", "overlay"}

// diskModulesFor returns the modules to load after base (guestDrivers'
// modules) for diskDrivers, in load order: those of the combined
// resolution that base does not hold already.
func diskModulesFor(dir string, base []string) ([]string, error) {
	all, err := resolveModules(dir, append(append([]string(nil), guestDrivers...), diskDrivers...))
	if err != nil {
		return nil, fmt.Errorf("microvm: root disks: %w", err)
	}
	have := map[string]bool{}
	for _, m := range base {
		have[m] = true
	}
	var out []string
	for _, m := range all {
		if !have[m] {
			out = append(out, m)
		}
	}
	return out, nil
}

// moduleNameOf is a module's canonical name: its file name without the
// extension, with dashes as underscores (as the kernel and depmod treat
// them).
func moduleNameOf(path string) string {
	base := filepath.Base(path)
	base = strings.TrimSuffix(base, ".ko")
	return strings.ReplaceAll(base, "-", "_")
}

// resolveModules returns the absolute paths of the modules to load for
// drivers, dependencies first, from the kernel module tree dir (a
// lib/modules/<version> directory). Dependencies come from modules.dep
// when depmod wrote one, else from each module's own modinfo "depends="
// (what modpost recorded at build time; a kernel package extracted
// without running depmod has no modules.dep). Built-in drivers
// (modules.builtin) need no file and are left out. Compressed modules are
// refused with a clear error: the guest's busybox insmod and this parser
// read plain ELF only.
func resolveModules(dir string, drivers []string) ([]string, error) {
	builtin, err := readBuiltin(dir)
	if err != nil {
		return nil, err
	}
	files, compressed, err := indexModules(dir)
	if err != nil {
		return nil, err
	}
	deps, err := readModulesDep(dir)
	if err != nil {
		return nil, err
	}
	depsOf := func(name string) ([]string, error) {
		if deps != nil {
			d, ok := deps[name]
			if !ok {
				return nil, fmt.Errorf("microvm: module %s is not in %s/modules.dep", name, dir)
			}
			return d, nil
		}
		return modinfoDepends(files[name])
	}
	var order []string
	state := map[string]int{} // 1: visiting, 2: done
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		switch state[name] {
		case 2:
			return nil
		case 1:
			return fmt.Errorf("microvm: module dependency cycle: %s", strings.Join(append(chain, name), " -> "))
		}
		if builtin[name] {
			state[name] = 2
			return nil
		}
		path, ok := files[name]
		if !ok {
			if c, ok := compressed[name]; ok {
				return fmt.Errorf("microvm: module %s is compressed (%s); only uncompressed .ko modules are supported", name, c)
			}
			return fmt.Errorf("microvm: kernel module %s (needed by %s) is neither built in nor under %s",
				name, strings.Join(append(chain, name), " <- "), dir)
		}
		state[name] = 1
		ds, err := depsOf(name)
		if err != nil {
			return err
		}
		for _, d := range ds {
			if err := visit(d, append(chain, name)); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, path)
		return nil
	}
	for _, d := range drivers {
		if err := visit(strings.ReplaceAll(d, "-", "_"), nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// indexModules maps module names to their files under dir/kernel and
// lists the compressed ones apart.
func indexModules(dir string) (plain, compressed map[string]string, err error) {
	plain, compressed = map[string]string{}, map[string]string{}
	root := filepath.Join(dir, "kernel")
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		name := d.Name()
		switch {
		case strings.HasSuffix(name, ".ko"):
			plain[moduleNameOf(name)] = p
		case strings.Contains(name, ".ko."):
			compressed[moduleNameOf(name[:strings.Index(name, ".ko.")+3])] = p
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("microvm: kernel modules: %w", err)
	}
	return plain, compressed, nil
}

// readBuiltin reads modules.builtin (one kernel/.../name.ko path a line);
// a missing file means nothing is known to be built in.
func readBuiltin(dir string) (map[string]bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, "modules.builtin"))
	if os.IsNotExist(err) {
		return map[string]bool{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("microvm: %w", err)
	}
	out := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out[moduleNameOf(l)] = true
		}
	}
	return out, nil
}

// readModulesDep parses depmod's modules.dep ("kernel/a.ko: kernel/b.ko
// kernel/c.ko" a line), returning nil when the file does not exist.
func readModulesDep(dir string) (map[string][]string, error) {
	f, err := os.Open(filepath.Join(dir, "modules.dep"))
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("microvm: %w", err)
	}
	defer f.Close()
	out := map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		mod, rest, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("microvm: modules.dep line %d: no colon", n)
		}
		var ds []string
		for _, d := range strings.Fields(rest) {
			ds = append(ds, moduleNameOf(strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(d, ".xz"), ".zst"), ".gz")))
		}
		name := moduleNameOf(strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(mod, ".xz"), ".zst"), ".gz"))
		out[name] = ds
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("microvm: modules.dep: %w", err)
	}
	return out, nil
}

// modinfoDepends reads the "depends=" entry of a module's .modinfo
// section (NUL-separated key=value strings).
func modinfoDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("microvm: module %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("microvm: module %s has no .modinfo section", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("microvm: module %s: .modinfo: %w", path, err)
	}
	return parseModinfoDepends(data), nil
}

// parseModinfoDepends extracts the sorted, de-duplicated module names of
// the depends= entries in a .modinfo blob.
func parseModinfoDepends(data []byte) []string {
	seen := map[string]bool{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		v, ok := bytes.CutPrefix(kv, []byte("depends="))
		if !ok {
			continue
		}
		for _, d := range strings.Split(string(v), ",") {
			if d = strings.TrimSpace(d); d != "" {
				seen[strings.ReplaceAll(d, "-", "_")] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for d := range seen {
		out = append(out, d)
	}
	sort.Strings(out)
	return out
}
