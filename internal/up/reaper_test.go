package up

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/sdk"
)

// TestOrphanZombiesReaped: a process orphaned in a sandbox is re-parented
// to the agent (pid 1) and reaped once it exits (the agent scans on
// SIGCHLD), while the exit status of commands the agent started stays
// theirs.
func TestOrphanZombiesReaped(t *testing.T) {
	c := newSPClient(t)
	s := spCreate(t, c)
	ctx := spCtx(t, 60*time.Second)
	// The subshell exits at once; its sleep becomes an orphan of pid 1 and
	// exits 0.2 s later.
	if code, err := s.Run(ctx, "(sleep 0.2 &); (sleep 0.3 &); exit 7", sdk.RunOptions{}); err != nil || code != 7 {
		t.Fatalf("orphaning command: code %d, %v (want the command's own status 7)", code, err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		var out bytes.Buffer
		code, err := s.Run(ctx, `for f in /proc/[0-9]*/stat; do read -r l < "$f" 2>/dev/null && echo "$l"; done`, sdk.RunOptions{Stdout: &out})
		if err != nil || code != 0 {
			t.Fatalf("list processes: code %d, %v", code, err)
		}
		var zombies []string
		for _, l := range strings.Split(out.String(), "\n") {
			if i := strings.LastIndexByte(l, ')'); i > 0 && strings.HasPrefix(strings.TrimSpace(l[i+1:]), "Z") {
				zombies = append(zombies, l)
			}
		}
		if len(zombies) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphaned zombies not reaped: %q", zombies)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
