package up

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// TestBaseTemplates: base runs the Debian base image when it is built
// (python3, node, sudo for user as in E2B), and base-host (the host's
// /usr under a generated /etc) stays creatable.
func TestBaseTemplates(t *testing.T) {
	c := newClient(t)
	create := func(template string) *sdk.Sandbox {
		sbx, err := c.CreateSandbox(ctxFor(t, 30*time.Second), sdk.CreateOptions{Template: template, Secure: true, Timeout: 5 * time.Minute})
		if err != nil {
			t.Fatalf("create %s: %v", template, err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			if err := c.KillSandbox(ctx, sbx.ID); err != nil && !errors.Is(err, sdk.ErrNotFound) {
				t.Errorf("kill %s: %v", sbx.ID, err)
			}
		})
		return sbx
	}
	host := create(ns.TemplateBaseHost)
	if r := mustRun(t, host, "cat /etc/os-release", ""); !strings.Contains(r.stdout, "SPACE sandbox") {
		t.Errorf("base-host is not the host template: %q", r.stdout)
	}
	if _, err := baseimage.Lookup(baseimage.Config{}); err != nil {
		testenv.Skipf(t, "base runs the host's /usr here: %v", err)
	}
	sbx := create("")
	r := mustRun(t, sbx, "grep -q '^ID=debian' /etc/os-release && python3 -c 'print(1)' && node -e 'console.log(2)' && id -un && sudo -n id -u && pwd", "")
	if r.stdout != "1\n2\nuser\n0\n/home/user\n" {
		t.Fatalf("base: %q (stderr %q)", r.stdout, r.stderr)
	}
}
