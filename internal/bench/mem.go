package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/sdk"
)

// ProcMem is one process's memory, in KiB.
type ProcMem struct {
	RSS, PSS, RSSAnon, RSSFile int64
}

// Add sums two measurements.
func (m ProcMem) Add(o ProcMem) ProcMem {
	return ProcMem{m.RSS + o.RSS, m.PSS + o.PSS, m.RSSAnon + o.RSSAnon, m.RSSFile + o.RSSFile}
}

// ReadProcMem reads VmRSS, RssAnon and RssFile from /proc/<pid>/status and
// Pss from /proc/<pid>/smaps_rollup.
func ReadProcMem(pid int) (ProcMem, error) {
	var m ProcMem
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return m, err
	}
	fields := map[string]*int64{"VmRSS:": &m.RSS, "RssAnon:": &m.RSSAnon, "RssFile:": &m.RSSFile}
	scanKB(st, fields)
	sm, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return m, err
	}
	scanKB(sm, map[string]*int64{"Pss:": &m.PSS})
	if m.RSS == 0 {
		return m, fmt.Errorf("pid %d: no VmRSS (kernel thread or exited)", pid)
	}
	return m, nil
}

func scanKB(b []byte, fields map[string]*int64) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 {
			if dst, ok := fields[f[0]]; ok {
				*dst, _ = strconv.ParseInt(f[1], 10, 64)
			}
		}
	}
}

// MemResult is per-sandbox memory of idle sandboxes (host bridge + agent)
// and the baseline (an idle minimal Go process).
type MemResult struct {
	Host, Guest, Sum []ProcMem
	// Tasks and Procs are each sandbox's threads and processes on the
	// host: spaced-host, netgtw if started, everything in its pid
	// namespace (the agent is pid 1).
	Tasks, Procs []float64
	// Idle is the minimal Go process; zero if it could not be built.
	Idle        ProcMem
	IdleThreads int
	IdleErr     error
}

// MeasureMemory creates n sandboxes, uses each once (a 4 KiB write and
// read and an `echo`), lets them sit for settle, then reads the memory of
// each one's spaced-host and agent. The sandboxes are killed afterwards.
func MeasureMemory(ctx context.Context, p *Platform, n int, settle time.Duration) (MemResult, error) {
	var res MemResult
	var sbxs []*sdk.Sandbox
	defer func() {
		for _, s := range sbxs {
			_ = s.Kill(context.WithoutCancel(ctx))
		}
	}()
	data := bytes.Repeat([]byte("x"), 4096)
	for range n {
		s, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute})
		if err != nil {
			return res, fmt.Errorf("create: %w", err)
		}
		sbxs = append(sbxs, s)
		if _, err := s.WriteFile(ctx, "/home/user/m.bin", data); err != nil {
			return res, fmt.Errorf("write: %w", err)
		}
		if _, err := s.ReadFile(ctx, "/home/user/m.bin"); err != nil {
			return res, fmt.Errorf("read: %w", err)
		}
		if code, err := s.Run(ctx, "echo hello", sdk.RunOptions{}); err != nil || code != 0 {
			return res, fmt.Errorf("run echo: code %d, %v", code, err)
		}
	}
	select {
	case <-time.After(settle):
	case <-ctx.Done():
		return res, ctx.Err()
	}
	byNS := map[string][]procInfo{}
	for _, pi := range scanProcs() {
		byNS[pi.pidns] = append(byNS[pi.pidns], pi)
	}
	for _, s := range sbxs {
		hp, gp, ok := p.BridgePID(s.ID)
		if !ok {
			return res, fmt.Errorf("sandbox %s: no active bridge", s.ID)
		}
		h, err := ReadProcMem(hp)
		if err != nil {
			return res, fmt.Errorf("spaced-host of %s: %w", s.ID, err)
		}
		g, err := ReadProcMem(gp)
		if err != nil {
			return res, fmt.Errorf("agent of %s: %w", s.ID, err)
		}
		res.Host = append(res.Host, h)
		res.Guest = append(res.Guest, g)
		res.Sum = append(res.Sum, h.Add(g))
		tasks, procs := procThreads(hp), 1
		for _, w := range p.Workers {
			if gw, ok := w.Manager().GatewayPID(s.ID); ok {
				tasks, procs = tasks+procThreads(gw), procs+1
			}
		}
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", gp)); err == nil {
			for _, m := range byNS[ns] {
				tasks, procs = tasks+m.threads, procs+1
			}
		}
		res.Tasks, res.Procs = append(res.Tasks, float64(tasks)), append(res.Procs, float64(procs))
	}
	res.Idle, res.IdleThreads, res.IdleErr = idleGoProcess(ctx, settle)
	return res, nil
}

// idleGoProcess builds internal/bench/idleproc the way spaced-guest is
// built, runs it for settle and measures it (memory and threads).
func idleGoProcess(ctx context.Context, settle time.Duration) (ProcMem, int, error) {
	dir, err := os.MkdirTemp("", "space-bench-idle-")
	if err != nil {
		return ProcMem{}, 0, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "idle")
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "github.com/spacesbx/space/internal/bench/idleproc")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return ProcMem{}, 0, fmt.Errorf("build idle process: %v: %s", err, bytes.TrimSpace(out))
	}
	cmd := exec.Command(bin)
	if err := cmd.Start(); err != nil {
		return ProcMem{}, 0, err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	time.Sleep(settle)
	m, err := ReadProcMem(cmd.Process.Pid)
	return m, procThreads(cmd.Process.Pid), err
}

// medianMem returns the per-field medians of ms.
func medianMem(ms []ProcMem) ProcMem {
	pick := func(f func(ProcMem) int64) int64 {
		xs := make([]float64, len(ms))
		for i, m := range ms {
			xs[i] = float64(f(m))
		}
		return int64(Median(xs))
	}
	return ProcMem{
		RSS:     pick(func(m ProcMem) int64 { return m.RSS }),
		PSS:     pick(func(m ProcMem) int64 { return m.PSS }),
		RSSAnon: pick(func(m ProcMem) int64 { return m.RSSAnon }),
		RSSFile: pick(func(m ProcMem) int64 { return m.RSSFile }),
	}
}

func mib(kib int64) float64 { return float64(kib) / 1024 }
