package gateway

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/testenv"
)

// TestNetnsDialerPath: a microVM's ports are dialed at its address in a
// namespace named by its bind mount (the worker's egress namespace),
// checked against the recorded inode; a loopback, unspecified or IPv6
// target is refused (the egress namespace's loopback is the worker's).
func TestNetnsDialerPath(t *testing.T) {
	testenv.RequireRoot(t, "network namespaces and bind mounts")
	if _, err := exec.LookPath("python3"); err != nil {
		testenv.Skipf(t, "python3 not available")
	}
	for _, a := range []string{"127.0.0.1", "0.0.0.0", "::1", "fd00::2"} {
		if _, err := OpenNetnsPath("/proc/self/ns/net", 0, netip.MustParseAddr(a)); err == nil || errors.Is(err, ErrNetnsMismatch) {
			t.Errorf("target %s: %v", a, err)
		}
	}
	const script = `
import socket, subprocess
subprocess.run(["ip","link","set","lo","up"], check=True)
subprocess.run(["ip","addr","add","10.250.0.2/32","dev","lo"], check=True)
s=socket.socket(); s.bind(("10.250.0.2",0)); s.listen(8); print(s.getsockname()[1], flush=True)
while True:
    c,_=s.accept(); c.sendall(b"vm\n"); c.close()
`
	cmd := exec.Command("unshare", "-n", "python3", "-c", script)
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		testenv.Skipf(t, "unshare: %v", err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	l, err := bufio.NewReader(out).ReadString('\n')
	port, perr := strconv.Atoi(strings.TrimSpace(l))
	if err != nil || perr != nil {
		t.Fatalf("helper: %q %v %v", l, err, perr)
	}
	path := filepath.Join(t.TempDir(), "egress.netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid), path, "", unix.MS_BIND, ""); err != nil {
		testenv.Skipf(t, "bind mount of a netns: %v", err)
	}
	defer unix.Unmount(path, unix.MNT_DETACH)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	target := netip.MustParseAddr("10.250.0.2")
	if _, err := OpenNetnsPath(path, st.Ino+1, target); !errors.Is(err, ErrNetnsMismatch) {
		t.Fatalf("wrong inode: %v", err)
	}
	d, err := OpenNetnsPath(path, st.Ino, target)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	c, err := d.DialPort(context.Background(), port)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(c)
	c.Close()
	if string(b) != "vm\n" {
		t.Fatalf("reached %q", b)
	}
}
