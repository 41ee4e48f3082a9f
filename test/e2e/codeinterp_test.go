package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/testenv"
)

// TestCodeInterpreterMicroVM runs code-interpreter.test.mjs's microVM
// test (template code-interpreter-v1-vm: created from a snapshot taken with
// the server's kernel warm, its first runCode fast, contexts kept across
// pause/resume) with the unmodified @e2b/code-interpreter on a platform
// with the microvm substrate, and checks that it ran. TestE2BSDK runs the
// rest of the file.
func TestCodeInterpreterMicroVM(t *testing.T) {
	testenv.RequirePlatform(t)
	if _, err := os.Stat("node_modules/@e2b/code-interpreter/package.json"); err != nil {
		testenv.Skipf(t, "@e2b/code-interpreter is not installed (make e2e-deps installs it)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		testenv.Skipf(t, "node is not installed (make deps installs it)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		testenv.Skipf(t, "microvm: qemu-system-x86_64 not installed (make vm-deps installs it)")
	}
	if _, err := os.Stat(filepath.Join("..", "..", ".cache", "vm", "kernel", "vmlinuz")); err != nil {
		testenv.Skipf(t, "microvm: no guest kernel in .cache/vm/kernel (make vm-deps)")
	}
	if _, err := baseimage.LookupInterp(baseimage.InterpConfig{}); err != nil {
		testenv.Skipf(t, "the code interpreter image is not built (make build): %v", err)
	}
	p := testenv.StartPlatform(t, testenv.PlatformOptions{APIKey: apiKey, ReadyTimeout: 90 * time.Second})
	cmd := exec.Command("node", "--test", "--test-reporter=spec", "--test-name-pattern=^microVM", "code-interpreter.test.mjs")
	cmd.Env = append(p.Env(), "SPACE_TEST_CODEINTERP_VM=1")
	out, err := cmd.CombinedOutput()
	t.Logf("node --test code-interpreter.test.mjs (microVM):\n%s", out)
	if err != nil {
		t.Fatalf("microVM code interpreter test failed: %v", err)
	}
	if !strings.Contains(string(out), "✔ microVM") {
		t.Fatal("the microVM code interpreter test did not run")
	}
}
