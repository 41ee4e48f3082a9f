package microvm

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// cpioEntry is one entry read back by readCPIO.
type cpioEntry struct {
	name       string
	mode       uint32
	uid, gid   uint32
	rmaj, rmin uint32
	data       []byte
}

// readCPIO parses a newc archive strictly (the reference the writer is
// checked against; busybox cpio checks it independently).
func readCPIO(b []byte) ([]cpioEntry, error) {
	var out []cpioEntry
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	for {
		if off+110 > len(b) {
			return nil, fmt.Errorf("short header at %d", off)
		}
		h := b[off : off+110]
		if string(h[:6]) != "070701" {
			return nil, fmt.Errorf("bad magic at %d", off)
		}
		field := func(i int) uint32 {
			v, err := strconv.ParseUint(string(h[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				panic(err)
			}
			return uint32(v)
		}
		mode, uid, gid, size, rmaj, rmin, nsize := field(1), field(2), field(3), field(6), field(9), field(10), field(11)
		nameEnd := off + 110 + int(nsize)
		if nsize == 0 || nameEnd > len(b) || b[nameEnd-1] != 0 {
			return nil, fmt.Errorf("bad name at %d", off)
		}
		name := string(b[off+110 : nameEnd-1])
		dataOff := align(nameEnd)
		if dataOff+int(size) > len(b) {
			return nil, fmt.Errorf("short data for %s", name)
		}
		if name == "TRAILER!!!" {
			return out, nil
		}
		out = append(out, cpioEntry{name, mode, uid, gid, rmaj, rmin, b[dataOff : dataOff+int(size)]})
		off = align(dataOff + int(size))
	}
}

func TestCPIOWriterReadBack(t *testing.T) {
	var buf bytes.Buffer
	c := newCPIOWriter(&buf)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(c.Dir("d", 0o755, 0, 0))
	must(c.Dir("d/home", 0o700, 1000, 1000))
	must(c.Bytes("d/file", 0o644, []byte("hello")))
	must(c.Bytes("empty", 0o600, nil))
	must(c.Symlink("d/link", "file"))
	must(c.CharDev("console", 0o600, 5, 1))
	must(c.File("big", 0o755, 0, 0, 70000, bytes.NewReader(bytes.Repeat([]byte{7}, 70000))))
	if err := c.Dir("d", 0o755, 0, 0); err == nil {
		t.Error("duplicate entry accepted")
	}
	for _, bad := range []string{"/abs", "../up", "a/../b", "", ".."} {
		if err := c.Bytes(bad, 0o644, nil); err == nil {
			t.Errorf("name %q accepted", bad)
		}
	}
	if err := newCPIOWriter(io.Discard).File("short", 0o644, 0, 0, 10, strings.NewReader("abc")); err == nil {
		t.Error("short file accepted")
	}
	must(c.Close())
	if buf.Len()%512 != 0 {
		t.Errorf("archive length %d not padded to 512", buf.Len())
	}
	ents, err := readCPIO(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		name string
		mode uint32
		data string
	}{
		{"d", cpioDir | 0o755, ""}, {"d/home", cpioDir | 0o700, ""}, {"d/file", cpioReg | 0o644, "hello"},
		{"empty", cpioReg | 0o600, ""}, {"d/link", cpioSymlink | 0o777, "file"}, {"console", cpioChar | 0o600, ""},
	}
	if len(ents) != len(want)+1 {
		t.Fatalf("read %d entries, want %d", len(ents), len(want)+1)
	}
	for i, w := range want {
		e := ents[i]
		if e.name != w.name || e.mode != w.mode || string(e.data) != w.data {
			t.Errorf("entry %d = %q %o %q, want %q %o %q", i, e.name, e.mode, e.data, w.name, w.mode, w.data)
		}
	}
	if ents[1].uid != 1000 || ents[5].rmaj != 5 || ents[5].rmin != 1 || len(ents[6].data) != 70000 {
		t.Errorf("owner/device/size not kept: %+v %+v %d", ents[1], ents[5], len(ents[6].data))
	}

	// An independent reader: busybox cpio extracts the same tree.
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Log("busybox not installed: skipping the busybox cpio cross-check")
		return
	}
	dir := t.TempDir()
	cmd := exec.Command(bb, "cpio", "-i", "-d", "-m")
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(buf.Bytes())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("busybox cpio -i: %v: %s", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "d/file")); err != nil || string(b) != "hello" {
		t.Errorf("d/file = %q, %v", b, err)
	}
	if l, err := os.Readlink(filepath.Join(dir, "d/link")); err != nil || l != "file" {
		t.Errorf("d/link -> %q, %v", l, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "big")); err != nil || fi.Size() != 70000 || fi.Mode().Perm() != 0o755 {
		t.Errorf("big: %v %v", fi, err)
	}
}

// FuzzCPIO writes arbitrary files and checks the reader gets them back.
func FuzzCPIO(f *testing.F) {
	f.Add("a", []byte("x"), "b/c", []byte{}, uint16(0o644))
	f.Add("init", bytes.Repeat([]byte{0}, 5), "x", []byte("yy"), uint16(0o4755))
	f.Fuzz(func(t *testing.T, n1 string, d1 []byte, n2 string, d2 []byte, perm uint16) {
		var buf bytes.Buffer
		c := newCPIOWriter(&buf)
		m := os.FileMode(perm & 0o777)
		e1 := c.Bytes(n1, m, d1)
		e2 := c.Bytes(n2, m, d2)
		if err := c.Close(); err != nil {
			return
		}
		ents, err := readCPIO(buf.Bytes())
		if err != nil {
			t.Fatalf("read back: %v", err)
		}
		var want []string
		if e1 == nil {
			want = append(want, n1+"="+string(d1))
		}
		if e2 == nil {
			want = append(want, n2+"="+string(d2))
		}
		var got []string
		for _, e := range ents {
			got = append(got, e.name+"="+string(e.data))
		}
		if strings.Join(got, "\x01") != strings.Join(want, "\x01") {
			t.Fatalf("got %q, want %q", got, want)
		}
	})
}
