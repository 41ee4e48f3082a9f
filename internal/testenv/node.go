package testenv

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// NodeOptions configure a space-node joining a platform started with
// PlatformOptions.ExternalWorkers. Zero fields are the defaults.
type NodeOptions struct {
	// ID is --id (required): a node restarted with the same ID and Dir
	// is the same worker.
	ID string
	// Dir holds its data dir (Dir/data) and log (Dir/space-node.log).
	// Default: <platform Dir>/nodes/<ID>.
	Dir string
	// Env is its environment (a crash point armed in it). Default: this
	// process's.
	Env []string
	// Args are more space-node flags.
	Args []string
	// LogLevel is --log-level. Default info.
	LogLevel string
	// KeepSandboxes is --keep-sandboxes (see PlatformOptions). Default
	// false.
	KeepSandboxes bool
}

// Node is one running space-node.
type Node struct {
	ID, Dir, DataDir, LogPath string
	Cmd                       *exec.Cmd
	done                      chan struct{} // closed when Cmd.Wait returned
}

// LaunchNode starts a space-node for p (its etcd and snapshot store, as
// its banner names them) and waits until the control plane lists the
// worker as ready. The caller Stops or Kills it.
func LaunchNode(p *Platform, o NodeOptions) (_ *Node, err error) {
	if o.ID == "" {
		return nil, fmt.Errorf("testenv: a node needs an ID")
	}
	if p.EtcdEndpoints == "" {
		return nil, fmt.Errorf("testenv: platform %s runs its own workers (PlatformOptions.ExternalWorkers)", p.Dir)
	}
	if o.Dir == "" {
		o.Dir = filepath.Join(p.Dir, "nodes", o.ID)
	}
	if o.LogLevel == "" {
		o.LogLevel = "info"
	}
	n := &Node{ID: o.ID, Dir: o.Dir, DataDir: filepath.Join(o.Dir, "data"), LogPath: filepath.Join(o.Dir, "space-node.log"), done: make(chan struct{})}
	if err := os.MkdirAll(n.DataDir, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600) // a restart appends
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the node holds its own descriptor
	args := append([]string{"--metrics-addr", "127.0.0.1:0", "--id", o.ID, "--data-dir", n.DataDir, "--etcd-endpoints", p.EtcdEndpoints,
		"--snapshot-dir", p.SnapshotDir, "--log-level", o.LogLevel, fmt.Sprintf("--keep-sandboxes=%t", o.KeepSandboxes)}, o.Args...)
	n.Cmd = exec.Command(filepath.Join(p.BinDir, "space-node"), args...)
	n.Cmd.Env, n.Cmd.Stderr = o.Env, logf
	out, err := n.Cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := n.Cmd.Start(); err != nil {
		return nil, err
	}
	go func() { // owned: ends when the node closes its stdout and exits
		sc := bufio.NewScanner(out)
		for sc.Scan() {
		}
		_ = n.Cmd.Wait()
		close(n.done)
	}()
	deadline := time.Now().Add(90 * time.Second)
	for {
		if ok, _ := p.WorkerReady(o.ID); ok {
			return n, nil
		}
		select {
		case <-n.done:
			b, _ := os.ReadFile(n.LogPath)
			return nil, fmt.Errorf("space-node %s exited (%v) before it registered:\n%s", o.ID, n.Cmd.ProcessState, b)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			n.Kill()
			return nil, fmt.Errorf("space-node %s not registered after 90s", o.ID)
		}
	}
}

// WorkerReady reports whether the control plane lists worker id as ready.
func (p *Platform) WorkerReady(id string) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.APIURL+"/space/v1/workers", nil)
	if err != nil {
		return false, err
	}
	req.Header.Set("X-API-Key", p.APIKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	var ws []struct{ ID, State string }
	if err := json.NewDecoder(resp.Body).Decode(&ws); err != nil {
		return false, err
	}
	for _, w := range ws {
		if w.ID == id && w.State == "ready" {
			return true, nil
		}
	}
	return false, nil
}

// Log is the node's log so far (every run on its Dir).
func (n *Node) Log() string {
	b, _ := os.ReadFile(n.LogPath)
	return string(b)
}

// Kill ends the node with SIGKILL (a crash) and waits for it.
func (n *Node) Kill() {
	_ = n.Cmd.Process.Kill()
	<-n.done
}

// Stop interrupts the node and waits up to 30 s; a non-zero exit is an
// error.
func (n *Node) Stop() error {
	_ = n.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.done:
	case <-time.After(30 * time.Second):
		n.Kill()
		return fmt.Errorf("space-node %s still ran 30s after SIGTERM; killed", n.ID)
	}
	if code := n.Cmd.ProcessState.ExitCode(); code != 0 {
		return fmt.Errorf("space-node %s exited with %d after SIGTERM; log %s", n.ID, code, n.LogPath)
	}
	return nil
}

// WaitExit waits up to d for the node to end by itself (an armed crash
// point kills it) and returns how it ended; after d it is killed and the
// error says so.
func (n *Node) WaitExit(d time.Duration) (*os.ProcessState, error) {
	select {
	case <-n.done:
		return n.Cmd.ProcessState, nil
	case <-time.After(d):
		n.Kill()
		return n.Cmd.ProcessState, fmt.Errorf("space-node %s still ran %v later; killed", n.ID, d)
	}
}

// parseJoin reads the banner's space-node line of a platform without
// workers: its etcd endpoints and snapshot dir.
func parseJoin(banner string) (etcd, snapDir string) {
	for _, line := range strings.Split(banner, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "space-node" {
			continue
		}
		for i := 1; i+1 < len(f); i++ {
			switch f[i] {
			case "--etcd-endpoints":
				etcd = f[i+1]
			case "--snapshot-dir":
				snapDir = f[i+1]
			}
		}
	}
	return etcd, snapDir
}
