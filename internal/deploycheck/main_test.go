package deploycheck

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

// root is the repository root (tests run in internal/deploycheck).
var root = func() string {
	wd, _ := os.Getwd()
	return filepath.Join(wd, "..", "..")
}()

// servers are the binaries the deployment files run, and space for `space up`.
var servers = []string{"space-api", "space-edge", "space-node", "space"}

var (
	flagsOnce sync.Once
	flagSets  map[string]FlagSet
	flagsErr  error
	tmpBin    string
	// binDir is where the servers' binaries are (after binFlags).
	binDir string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if tmpBin != "" {
		os.RemoveAll(tmpBin)
	}
	os.Exit(code)
}

// binFlags returns every server's flags from its -h output: the binaries
// of $SPACE_BIN_DIR (make build), or, without it, a build of the four
// into a temp dir (the unit tier under -short skips instead).
func binFlags(t *testing.T) map[string]FlagSet {
	t.Helper()
	dir := os.Getenv("SPACE_BIN_DIR")
	if dir == "" && testing.Short() {
		testenv.Skipf(t, "needs the binaries' flags: SPACE_BIN_DIR=$PWD/bin after make build, or a run without -short (builds them)")
	}
	flagsOnce.Do(func() {
		if dir == "" {
			if tmpBin, flagsErr = os.MkdirTemp("", "deploycheck-bin-"); flagsErr != nil {
				return
			}
			dir = tmpBin
			args := []string{"build", "-o", dir + "/"}
			for _, s := range servers {
				args = append(args, "github.com/spacesbx/space/cmd/"+s)
			}
			if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
				flagsErr = fmt.Errorf("go build: %w\n%s", err, out)
				return
			}
		}
		binDir = dir
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		flagSets = map[string]FlagSet{}
		for _, s := range servers {
			var args []string
			if s == "space" {
				args = []string{"up"}
			}
			fs, err := HelpFlags(ctx, filepath.Join(dir, s), args...)
			if err != nil {
				flagsErr = err
				return
			}
			flagSets[s] = fs
		}
	})
	if flagsErr != nil {
		t.Fatal(flagsErr)
	}
	return flagSets
}

// built returns the binaries `make build` builds: the Makefile's CMDS
// and spaced-guest.
func built(t *testing.T) map[string]bool {
	t.Helper()
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CMDS\s*:=\s*(.+)$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("Makefile: no CMDS line")
	}
	out := map[string]bool{"spaced-guest": true}
	for _, c := range strings.Fields(string(m[1])) {
		out[c] = true
	}
	return out
}

func readFile(t *testing.T, parts ...string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(append([]string{root}, parts...)...))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// secretFlags are the flags whose values are keys.
var secretFlags = []string{"api-key", "edge-key"}

// wantErrs checks that errs has one error matching each pattern.
func wantErrs(t *testing.T, what string, errs []error, patterns ...string) {
	t.Helper()
	for _, p := range patterns {
		re := regexp.MustCompile(p)
		found := false
		for _, e := range errs {
			found = found || re.MatchString(e.Error())
		}
		if !found {
			t.Errorf("%s: no error matches %q; got %v", what, p, errs)
		}
	}
	if len(errs) == 0 {
		t.Errorf("%s: accepted", what)
	}
}
