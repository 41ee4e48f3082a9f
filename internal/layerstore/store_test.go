//go:build linux

package layerstore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestMain(m *testing.M) {
	if os.Getenv("LAYERSTORE_TEST_HELPER") != "" {
		os.Exit(helperAdd())
	}
	goleak.VerifyTestMain(m)
}

const testID = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func newStore(t testing.TB) *Store {
	t.Helper()
	s, err := New(Config{Root: filepath.Join(t.TempDir(), "store")})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestStoreNew(t *testing.T) {
	for _, cfg := range []Config{{}, {Root: "relative/dir"}, {Root: "/var/lib/a:b"}, {Root: "/var/lib/a,upperdir=/x"}, {Root: `/var/lib/a\b`}} {
		if _, err := New(cfg); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("New(%+v) = %v, want ErrInvalid", cfg, err)
		}
	}
	root := filepath.Join(t.TempDir(), "store")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"", "layers", "tmp", "locks"} {
		fi, err := os.Stat(filepath.Join(s.Root(), d))
		if err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("%s/%s: %v %v, want 0700", root, d, fi.Mode(), err)
		}
	}
}

func TestStoreDir(t *testing.T) {
	s := newStore(t)
	for _, id := range []string{"", "sha256:abc", "sha512:" + strings.Repeat("0", 64), "sha256:" + strings.Repeat("A", 64), "sha256:../../" + strings.Repeat("0", 58)} {
		if _, err := s.Dir(id); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Dir(%q) = %v, want ErrInvalid", id, err)
		}
		if _, err := s.Add(context.Background(), id, func(string) error { return nil }); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Add(%q) = %v, want ErrInvalid", id, err)
		}
	}
	if _, err := s.Dir(testID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Dir of an absent layer = %v, want ErrNotFound", err)
	}
}

func TestStoreAddOnce(t *testing.T) {
	s := newStore(t)
	var fills atomic.Int32
	var wg sync.WaitGroup
	dirs := make([]string, 8)
	errs := make([]error, 8)
	for i := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dirs[i], errs[i] = s.Add(context.Background(), testID, func(dir string) error {
				fills.Add(1)
				time.Sleep(50 * time.Millisecond)
				return os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644)
			})
		}()
	}
	wg.Wait()
	for i := range dirs {
		if errs[i] != nil || dirs[i] != dirs[0] {
			t.Fatalf("Add %d: %q %v", i, dirs[i], errs[i])
		}
	}
	if n := fills.Load(); n != 1 {
		t.Fatalf("fill ran %d times, want 1", n)
	}
	if d, err := s.Dir(testID); err != nil || d != dirs[0] {
		t.Fatalf("Dir = %q %v", d, err)
	}
	if fi, err := os.Stat(dirs[0]); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("layer root: %v %v, want 0755", fi.Mode(), err)
	}
	if b, _ := os.ReadFile(filepath.Join(dirs[0], "f")); string(b) != "x" {
		t.Error("content missing")
	}
}

func TestStoreAddFailurePublishesNothing(t *testing.T) {
	s := newStore(t)
	boom := errors.New("boom")
	_, err := s.Add(context.Background(), testID, func(dir string) error {
		if err := os.WriteFile(filepath.Join(dir, "partial"), []byte("x"), 0o644); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Add = %v, want boom", err)
	}
	if _, err := s.Dir(testID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Dir after a failed fill = %v, want ErrNotFound", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Root(), "tmp")); len(ents) != 0 {
		t.Fatalf("tmp not cleaned: %v", ents)
	}
	if _, err := s.Add(context.Background(), testID, func(string) error { return nil }); err != nil {
		t.Fatalf("Add after a failure: %v", err)
	}
}

func TestStoreAddRemovesLeftovers(t *testing.T) {
	s := newStore(t)
	stale := filepath.Join(s.Root(), "tmp", strings.Replace(testID, ":", "-", 1)+".crashed")
	if err := os.MkdirAll(filepath.Join(stale, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Add(context.Background(), testID, func(string) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("leftover of a dead filler kept: %v", err)
	}
}

func TestNewRemovesDeadFillersLeftovers(t *testing.T) {
	root := filepath.Join(t.TempDir(), "store")
	s := newStoreAt(t, root)
	name := strings.Replace(testID, ":", "-", 1)
	other := strings.Replace(upperID, ":", "-", 1)
	dead := filepath.Join(root, "tmp", name+".dead")
	live := filepath.Join(root, "tmp", other+".live")
	for _, d := range []string{dead, live} {
		if err := os.MkdirAll(filepath.Join(d, "x"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A live filler (here: this test) holds its id's lock.
	unlock, err := s.lock(context.Background(), other)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	newStoreAt(t, root)
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("a dead filler's dir kept: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("a live filler's dir removed: %v", err)
	}
}

func newStoreAt(t *testing.T, root string) *Store {
	t.Helper()
	s, err := New(Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestStoreAddWaitHonoursContext(t *testing.T) {
	s := newStore(t)
	release := make(chan struct{})
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := s.Add(context.Background(), testID, func(string) error {
			close(started)
			<-release
			return nil
		})
		done <- err
	}()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := s.Add(ctx, testID, func(string) error { t.Error("second fill ran"); return nil })
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting Add = %v, want DeadlineExceeded", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// helperAdd is the child process of TestStoreAddAcrossProcesses: it adds
// the test layer to the store named by the environment, logging its fill.
func helperAdd() int {
	root := os.Getenv("LAYERSTORE_TEST_HELPER")
	s, err := New(Config{Root: root})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	_, err = s.Add(context.Background(), testID, func(dir string) error {
		f, err := os.OpenFile(filepath.Join(filepath.Dir(root), "fills.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		fmt.Fprintln(f, os.Getpid())
		f.Close()
		time.Sleep(300 * time.Millisecond)
		return nil
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func TestStoreAddAcrossProcesses(t *testing.T) {
	root := filepath.Join(t.TempDir(), "store")
	var cmds []*exec.Cmd
	for range 3 {
		c := exec.Command(os.Args[0], "-test.run=^$")
		c.Env = append(os.Environ(), "LAYERSTORE_TEST_HELPER="+root)
		c.Stderr = os.Stderr
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, c)
	}
	for _, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Fatalf("helper: %v", err)
		}
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(root), "fills.log"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n != 1 {
		t.Fatalf("%d processes filled the layer, want 1:\n%s", n, b)
	}
}
