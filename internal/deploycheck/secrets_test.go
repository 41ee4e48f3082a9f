package deploycheck

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A key given in the environment never appears in a binary's -h output
// (an environment value used as a flag's default is printed as the
// default: anyone who asks for help on a host, or reads a support
// ticket's pasted output, would see it).
func TestHelpDoesNotPrintSecrets(t *testing.T) {
	binFlags(t) // builds or finds the binaries
	const canary = "e2b_5ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7"
	env := []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, v := range []string{"SPACE_API_KEY", "SPACE_EDGE_KEY", "E2B_API_KEY", "SPACE_ACCESS_TOKEN", "E2B_ACCESS_TOKEN"} {
		env = append(env, v+"="+canary)
	}
	for _, s := range servers {
		var args []string
		if s == "space" {
			args = []string{"up"}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, filepath.Join(binDir, s), append(args, "-h")...)
		cmd.Env = env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.Run()
		cancel()
		if out.Len() == 0 {
			t.Errorf("%s -h printed nothing", s)
		}
		if strings.Contains(out.String(), canary) {
			t.Errorf("%s %s -h prints a key taken from the environment", s, strings.Join(args, " "))
		}
	}
}
