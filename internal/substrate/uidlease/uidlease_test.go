//go:build linux

package uidlease

import "testing"

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
