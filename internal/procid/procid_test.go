package procid

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestParseStartTime(t *testing.T) {
	stat := []byte("1234 (we ird) name)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 10000 100")
	got, err := parseStartTime(stat)
	if err != nil || got != 987654 {
		t.Fatalf("got %d, %v", got, err)
	}
	for _, bad := range []string{"", "1 (x) S 1 2", "no paren", "1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 xx"} {
		if _, err := parseStartTime([]byte(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func FuzzParseStartTime(f *testing.F) {
	f.Add([]byte("1 (a) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0"))
	f.Fuzz(func(t *testing.T, b []byte) { parseStartTime(b) })
}

func TestReadSelfAndCheck(t *testing.T) {
	p, err := Read(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	q := p
	q.StartTime++
	if err := q.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("start-time mismatch not detected: %v", err)
	}
	q = p
	q.ExeIno++
	if err := q.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("executable mismatch not detected: %v", err)
	}
}

func TestCheckExitedProcess(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p, err := Read(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	if err := p.Check(); !errors.Is(err, ErrMismatch) {
		t.Fatalf("dead process passed: %v", err)
	}
}

func TestVerifyPeer(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	self, _ := Read(os.Getpid())
	if err := VerifyPeer(c, self); err != nil {
		t.Fatalf("self as peer: %v", err)
	}
	other := self
	other.PID = 1
	if err := VerifyPeer(c, other); !errors.Is(err, ErrMismatch) {
		t.Fatalf("wrong pid accepted: %v", err)
	}
	tcp, _ := net.Listen("tcp", "127.0.0.1:0")
	defer tcp.Close()
	tc, _ := net.Dial("tcp", tcp.Addr().String())
	defer tc.Close()
	if err := VerifyPeer(tc, self); err == nil {
		t.Fatal("tcp connection accepted")
	}
}
