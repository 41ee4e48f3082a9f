//go:build linux

package uidlease

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

func TestAcquireDistinctAndReleased(t *testing.T) {
	dir := t.TempDir()
	a, err := Acquire(dir, 100000, 2, 65536, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Acquire(dir, 100000, 2, 65536, 0)
	if err != nil {
		t.Fatal(err)
	}
	if a.First() == b.First() || (a.First()-100000)%65536 != 0 || (b.First()-100000)%65536 != 0 {
		t.Fatalf("ranges %d and %d", a.First(), b.First())
	}
	if _, err := Acquire(dir, 100000, 2, 65536, 0); err == nil {
		t.Fatal("a third range out of two was handed out")
	}
	a.Release()
	a.Release()
	c, err := Acquire(dir, 100000, 2, 65536, 0)
	if err != nil {
		t.Fatalf("released range not reusable: %v", err)
	}
	c.Release()
	b.Release()
	if _, err := Acquire(dir, 1<<31, 1<<16, 1<<16, 0); err == nil {
		t.Fatal("a range past the largest uid was accepted")
	}
}

// A range bound to a process stays leased after its holder lets go of the
// lock (a worker restart), is taken back only for that very process, and
// is free again once that process is gone.
func TestBoundRangeOutlivesItsHolder(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	a, err := Acquire(dir, 100000, 1, 65536, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Bind(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	a.Detach() // the holder is gone; the sandbox runs on
	if l, err := Acquire(dir, 100000, 1, 65536, 0); err == nil {
		l.Release()
		t.Fatal("a range bound to a live process was handed out again")
	}
	if _, err := Adopt(dir, 100000, os.Getpid()); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("adopt for another process: %v, want ErrNotOwner", err)
	}
	b, err := Adopt(dir, 100000, cmd.Process.Pid)
	if err != nil {
		t.Fatalf("adopt for its owner: %v", err)
	}
	if _, err := Acquire(dir, 100000, 1, 65536, 0); err == nil {
		t.Fatal("an adopted range was handed out again")
	}
	b.Detach()
	cmd.Process.Kill()
	cmd.Wait()
	c, err := Acquire(dir, 100000, 1, 65536, 0)
	if err != nil {
		t.Fatalf("the range of a dead owner is not free: %v", err)
	}
	if _, err := Adopt(dir, 100000, cmd.Process.Pid); err == nil {
		t.Fatal("adopted a range whose owner died and that was leased again")
	}
	c.Release()
}

func TestMalformedTagIsFree(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "100000"), []byte("garbage ) 1 x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := Acquire(dir, 100000, 1, 65536, 0)
	if err != nil {
		t.Fatalf("a malformed tag held the range: %v", err)
	}
	l.Release()
}

// A holder that died after a process of its range started but before the
// tag named that process (a VMM started just before its worker died)
// leaves a tag naming a dead owner: the range is still not handed out
// while any process runs with a uid in it.
func TestRangeWithAnUnnamedProcessIsNotHandedOut(t *testing.T) {
	testenv.RequireRoot(t, "a process running as another uid")
	dir := t.TempDir()
	const first, stride = 3900000, 16
	boot, err := bootID()
	if err != nil {
		t.Fatal(err)
	}
	dead := fmt.Sprintf("%s %d %d\n", boot, 1<<22-1, 1) // no such process
	if err := os.WriteFile(filepath.Join(dir, strconv.Itoa(first)), []byte(dead), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: first + 5, Gid: first + 5}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if l, err := Acquire(dir, first, 1, stride, 0); err == nil {
		l.Release()
		t.Fatal("a range with a process running in it was handed out")
	}
	cmd.Process.Kill()
	cmd.Wait()
	l, err := Acquire(dir, first, 1, stride, 0)
	if err != nil {
		t.Fatalf("the range of a dead owner with nothing running in it: %v", err)
	}
	l.Release()
}
