package worker

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

// TestPidBudget: a few sandboxes fit any host; more than kernel.pid_max
// can hold are reported naming the limit and the sysctl that raises it.
func TestPidBudget(t *testing.T) {
	if s := PidBudget(10); s != "" {
		t.Fatalf("10 sandboxes: %q", s)
	}
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		testenv.Skipf(t, "%v", err)
	}
	pidMax, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	n := pidMax/TasksPerIdleSandbox + 1
	s := PidBudget(n)
	if !strings.Contains(s, "kernel.pid_max is "+strconv.Itoa(pidMax)) || !strings.Contains(s, "sysctl -w kernel.pid_max=") {
		t.Fatalf("%d sandboxes with pid_max %d: %q", n, pidMax, s)
	}
}
