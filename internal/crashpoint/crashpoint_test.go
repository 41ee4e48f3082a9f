package crashpoint

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
)

func TestParse(t *testing.T) {
	for _, c := range []struct {
		spec string
		name string
		nth  int64
		ok   bool
	}{
		{InstallPersisted, InstallPersisted, 1, true},
		{ArchiveEntry + "@3", ArchiveEntry, 3, true},
		{ArchiveEntry + "@1", ArchiveEntry, 1, true},
		{ArchiveEntry + "@0", "", 0, false},
		{ArchiveEntry + "@-2", "", 0, false},
		{ArchiveEntry + "@+2", "", 0, false},
		{ArchiveEntry + "@", "", 0, false},
		{ArchiveEntry + "@ 2", "", 0, false},
		{ArchiveEntry + "@2@3", "", 0, false},
		{ArchiveEntry + "@99999999999999999999", "", 0, false},
		{"sbxmanager.install.persistd", "", 0, false},
		{"@3", "", 0, false},
	} {
		name, nth, err := Parse(c.spec)
		if (err == nil) != c.ok || name != c.name || nth != c.nth {
			t.Errorf("Parse(%q) = %q, %d, %v; want %q, %d, ok=%v", c.spec, name, nth, err, c.name, c.nth, c.ok)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Parse(%q): %v is not ErrInvalid", c.spec, err)
		}
	}
}

func TestPointsAreUnique(t *testing.T) {
	seen := map[string]bool{}
	for _, p := range Points {
		if seen[p.Name] || p.Where == "" || strings.Count(p.Name, ".") != 2 {
			t.Errorf("point %+v: duplicate, without a place, or not <package>.<operation>.<state>", p)
		}
		seen[p.Name] = true
	}
}

func TestArmAndDisarm(t *testing.T) {
	t.Cleanup(func() { Arm("") })
	if err := Arm("nonsense"); err == nil {
		t.Fatal("armed an unknown point")
	}
	if err := Arm(PauseFrozen + "@2"); err != nil {
		t.Fatal(err)
	}
	if name, nth := Armed(); name != PauseFrozen || nth != 2 {
		t.Fatalf("armed %q@%d", name, nth)
	}
	Hit(ResumeThawed) // another point: nothing happens
	if err := Arm(""); err != nil {
		t.Fatal(err)
	}
	if name, _ := Armed(); name != "" {
		t.Fatalf("still armed: %q", name)
	}
	Hit(PauseFrozen) // disarmed: nothing happens
}

// The armed point kills the process with SIGKILL on its Nth hit and not
// before; run in a child so the kill is observable.
func TestHitKillsOnNthHit(t *testing.T) {
	if os.Getenv("CRASHPOINT_TEST_CHILD") == "1" {
		if err := Arm(MoveReserved + "@3"); err != nil {
			os.Exit(3)
		}
		Hit(MoveReserved)
		Hit(MoveInstalled)
		Hit(MoveReserved)
		os.Stdout.WriteString("survived two hits\n")
		Hit(MoveReserved)
		os.Stdout.WriteString("survived the third hit\n")
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHitKillsOnNthHit$")
	cmd.Env = append(os.Environ(), "CRASHPOINT_TEST_CHILD=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if err == nil || !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child ended with %v, want SIGKILL; stdout %q", err, out)
	}
	if string(out) != "survived two hits\n" {
		t.Errorf("child stdout %q: the point fired on the wrong hit", out)
	}
	if want := HitMessage + MoveReserved + " (hit 3)"; !strings.Contains(stderr.String(), want) {
		t.Errorf("child stderr %q lacks %q", stderr.String(), want)
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{InstallPersisted, ArchiveEntry + "@3", "x@", "@", ArchiveEntry + "@-1", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		name, nth, err := Parse(spec)
		if err != nil {
			return
		}
		if !Known(name) || nth < 1 {
			t.Fatalf("Parse(%q) accepted %q@%d", spec, name, nth)
		}
		// What was accepted names itself again.
		if spec != name && !strings.HasPrefix(spec, name+"@") {
			t.Fatalf("Parse(%q) = %q, not a prefix", spec, name)
		}
	})
}

// Hit on an unarmed process is one atomic load: cheap enough for any
// path.
func BenchmarkHitDisarmed(b *testing.B) {
	for b.Loop() {
		Hit(InstallPersisted)
	}
}
