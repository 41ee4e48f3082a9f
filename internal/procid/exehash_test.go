package procid

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// startBin runs bin (a copy of sleep); ETXTBSY right after the file was
// written (its fd inherited by a child forked meanwhile) is retried.
func startBin(t *testing.T, bin string) *exec.Cmd {
	t.Helper()
	for i := 0; ; i++ {
		cmd := exec.Command(bin, "30")
		err := cmd.Start()
		if err == nil {
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			return cmd
		}
		if !errors.Is(err, syscall.ETXTBSY) || i == 50 {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func stop(cmd *exec.Cmd) { cmd.Process.Kill(); cmd.Wait() }

// The hash of an executable is reused only for the very same file: the
// same inode rewritten in place (new size, mtime, ctime) is hashed again.
func TestExeHashReusedOnlyForUnchangedFile(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "sleep")
	copyFile(t, "/bin/sleep", bin)
	c1 := startBin(t, bin)
	h1, err := Open(c1.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h1.Close()
	first := h1.Process().ExeSHA256
	if want := sha256File(t, bin); first != want {
		t.Fatalf("hash %s, file %s", first, want)
	}
	c2 := startBin(t, bin)
	h2, err := Open(c2.Process.Pid) // the same file: from the cache
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	if h2.Process().ExeSHA256 != first {
		t.Fatalf("same file, hashes %s and %s", h2.Process().ExeSHA256, first)
	}
	stop(c1)
	stop(c2)
	var before, after syscall.Stat_t
	syscall.Stat(bin, &before)
	f, err := os.OpenFile(bin, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("trailing bytes change the hash"))
	f.Close()
	syscall.Stat(bin, &after)
	if after.Ino != before.Ino || after.Size == before.Size {
		t.Fatalf("not rewritten in place: inode %d->%d size %d->%d", before.Ino, after.Ino, before.Size, after.Size)
	}
	c3 := startBin(t, bin)
	h3, err := Open(c3.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer h3.Close()
	if want := sha256File(t, bin); h3.Process().ExeSHA256 != want || want == first {
		t.Fatalf("after the rewrite: hash %s, file %s, before %s", h3.Process().ExeSHA256, want, first)
	}
}

// A statement from the launching process (ExeHash) is used only for a
// process whose executable is exactly the stated file.
func TestPrimeExeHash(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "sleep")
	copyFile(t, "/bin/sleep", bin)
	stmt, err := ExeHash(bin)
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Split(stmt, ":")
	if len(f) != 6 || f[5] != sha256File(t, bin) {
		t.Fatalf("statement %q", stmt)
	}
	// A statement about another file (here: another ctime) is not used for
	// this one; this file's own statement (forged content here, to see it
	// used) is.
	bogus := strings.Repeat("ab", 32)
	other := append([]string(nil), f...)
	ct, _ := strconv.ParseInt(f[4], 10, 64)
	other[4] = strconv.FormatInt(ct+1, 10)
	other[5] = bogus
	if err := PrimeExeHash(strings.Join(other, ":")); err != nil {
		t.Fatal(err)
	}
	copyFile(t, "/bin/sleep", bin+"2") // another inode, not primed
	h, err := Open(startBin(t, bin+"2").Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if h.Process().ExeSHA256 != sha256File(t, bin+"2") {
		t.Fatalf("unprimed file: %s", h.Process().ExeSHA256)
	}
	h.Close()
	if err := PrimeExeHash(strings.Join(append(f[:5:5], bogus), ":")); err != nil {
		t.Fatal(err)
	}
	h, err = Open(startBin(t, bin).Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if h.Process().ExeSHA256 != bogus {
		t.Fatalf("primed file: %s", h.Process().ExeSHA256)
	}
	h.Close()
	for _, bad := range []string{"", "1:2:3:4:5", "1:2:3:4:5:zz", "a:2:3:4:5:" + bogus, "1:2:3:4:5:" + bogus[:10]} {
		if err := PrimeExeHash(bad); err == nil {
			t.Errorf("malformed statement %q accepted", bad)
		}
	}
}
