package bench

// Density (make density): how many idle ns sandboxes one host holds, what
// each costs the host in tasks (every process and thread takes a pid from
// kernel.pid_max), processes and memory (PSS), and exec latency at that
// density beside the same at low density, on one platform.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/internal/up"
	"github.com/spacesbx/space/sdk"
)

// DensityConfig sizes a density run.
type DensityConfig struct {
	// BinDir holds spaced-host, netgtw and spaced-guest (make build).
	BinDir string
	// Sandboxes is the target number of idle sandboxes (one worker of
	// that capacity).
	Sandboxes int
	// Low is the low-density baseline: figures measured with this many.
	Low int
	// ExecSamples execs are timed at each density.
	ExecSamples int
	// Clients create sandboxes concurrently.
	Clients int
	// TaskReserve: creating stops early when fewer host tasks than this
	// remain below kernel.pid_max (the rest of the machine keeps them).
	TaskReserve int
	// Settle is the idle time before measuring.
	Settle time.Duration
	// MaxFailures failed creates or execs (each retried once) end the
	// filling; fewer are counted and reported (a shared, overloaded
	// machine times out now and then).
	MaxFailures int
	Log         io.Writer
}

// DefaultDensityConfig is make density: 2,500 sandboxes.
func DefaultDensityConfig() DensityConfig {
	return DensityConfig{Sandboxes: 2500, Low: 10, ExecSamples: 200, Clients: 4, TaskReserve: 1500, Settle: 25 * time.Second, MaxFailures: 10}
}

// SandboxCost is the host cost of idle sandboxes, per sandbox (medians
// over sandboxes, except the worker's share, which is a mean).
type SandboxCost struct {
	N int
	// Tasks is the threads of the sandbox's processes (spaced-host, netgtw
	// if started, everything in its pid namespace) per sandbox; Worker is
	// the platform process's own threads added per sandbox.
	Tasks, Worker float64
	Procs         float64
	PSSKiB        float64
	// Per component (medians): threads and PSS (KiB).
	HostThreads, AgentThreads float64
	HostPSS, AgentPSS         float64
	// AgentAnon and AgentFile are the agent's resident anonymous and
	// file-backed memory (KiB, medians).
	AgentAnon, AgentFile float64
	// HostTasks is every task on the machine (/proc/loadavg) at the time.
	HostTasks int
}

// DensityResult is one density run.
type DensityResult struct {
	Target, Reached int
	// Stopped says why fewer than Target were created.
	Stopped string
	PidMax  int
	// Failures are the creates and execs that failed twice while filling
	// (the first few of them in FailureSamples).
	Failures          int
	FailureSamples    []string
	Low, High         SandboxCost
	ExecLow, ExecHigh []time.Duration
	CreateWall        time.Duration
}

// RunDensity measures density and writes the table and notes to out.
func RunDensity(ctx context.Context, cfg DensityConfig, out io.Writer) error {
	if cfg.Log == nil {
		cfg.Log = os.Stderr
	}
	if cfg.BinDir == "" {
		return errors.New("density: BinDir (SPACE_BIN_DIR) is required: run make density")
	}
	t0 := time.Now()
	progress := func(format string, a ...any) {
		fmt.Fprintf(cfg.Log, "[%6.1fs] %s\n", time.Since(t0).Seconds(), fmt.Sprintf(format, a...))
	}
	root, err := os.MkdirTemp("", "space-density-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	res, err := MeasureDensity(ctx, cfg, root, progress)
	if err != nil {
		return err
	}
	fmt.Fprintln(out)
	if err := WriteTable(out, res.Rows()); err != nil {
		return err
	}
	fmt.Fprintln(out)
	fmt.Fprint(out, res.Notes())
	return nil
}

// MeasureDensity starts a one-worker platform of capacity cfg.Sandboxes
// under root, creates cfg.Low sandboxes (each used once: one exec) and
// measures, then fills up to cfg.Sandboxes (stopping early when the host
// runs short of tasks or a create fails) and measures again.
func MeasureDensity(ctx context.Context, cfg DensityConfig, root string, progress func(string, ...any)) (DensityResult, error) {
	res := DensityResult{Target: cfg.Sandboxes, PidMax: readInt("/proc/sys/kernel/pid_max")}
	log := discardLogger(cfg.Log)
	p, err := up.Start(ctx, up.Config{
		APIAddr: "127.0.0.1:0", EdgeAddr: "127.0.0.1:0", DataDir: filepath.Join(root, "data"), Workers: 1,
		Capacity: cfg.Sandboxes, APIKey: benchAPIKey, BinDir: cfg.BinDir, VMKernelDir: filepath.Join(root, "no-vm"), Logger: log,
	})
	if err != nil {
		return res, err
	}
	defer func() {
		progress("stopping %d sandboxes", res.Reached)
		p.Close()
	}()
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 2 * cfg.Clients
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey, HTTPClient: &http.Client{Transport: tr}})
	if err != nil {
		return res, err
	}
	plat := &Platform{Platform: p, Client: c}
	base := selfThreads()

	var sbxs []*sdk.Sandbox
	var mu sync.Mutex
	// fill creates sandboxes (each used once) until there are n, a create
	// fails, or the host nears its task limit.
	fail := func(what string) (enough bool) {
		mu.Lock()
		defer mu.Unlock()
		res.Failures++
		if len(res.FailureSamples) < 3 {
			res.FailureSamples = append(res.FailureSamples, what)
		}
		progress("failed (%d): %s", res.Failures, what)
		return res.Failures >= cfg.MaxFailures
	}
	fill := func(n int) error {
		var next atomic.Int64
		next.Store(int64(len(sbxs)))
		var stop atomic.Value
		var wg sync.WaitGroup
		for range cfg.Clients {
			wg.Go(func() {
				for stop.Load() == nil && ctx.Err() == nil {
					i := next.Add(1)
					if i > int64(n) {
						return
					}
					if i%50 == 0 {
						if t := hostTasks(); res.PidMax > 0 && res.PidMax-t < cfg.TaskReserve {
							stop.CompareAndSwap(nil, fmt.Sprintf("host tasks %d of kernel.pid_max %d: fewer than %d would be left for the rest of the machine", t, res.PidMax, cfg.TaskReserve))
							return
						}
					}
					s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: time.Hour})
					if err != nil {
						s, err = c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: time.Hour})
					}
					if err != nil {
						if fail(fmt.Sprintf("create %d: %v", i, err)) {
							stop.CompareAndSwap(nil, fmt.Sprintf("%d creates or execs failed, the last: create %d: %v", cfg.MaxFailures, i, err))
							return
						}
						next.Add(-1) // not created: another try
						continue
					}
					mu.Lock()
					sbxs = append(sbxs, s)
					k := len(sbxs)
					mu.Unlock()
					if _, err := s.Exec(ctx, []string{"/bin/echo", "hello"}, sdk.RunOptions{}); err != nil {
						if _, err = s.Exec(ctx, []string{"/bin/echo", "hello"}, sdk.RunOptions{}); err != nil && fail(fmt.Sprintf("exec in sandbox %d: %v", k, err)) {
							stop.CompareAndSwap(nil, fmt.Sprintf("%d creates or execs failed, the last: exec in sandbox %d: %v", cfg.MaxFailures, k, err))
							return
						}
					}
					if k%250 == 0 {
						progress("%d sandboxes (host tasks %d of %d)", k, hostTasks(), res.PidMax)
					}
				}
			})
		}
		wg.Wait()
		if s, ok := stop.Load().(string); ok {
			res.Stopped = s
		}
		return ctx.Err()
	}
	measure := func(label string) (SandboxCost, []time.Duration, error) {
		select {
		case <-time.After(cfg.Settle):
		case <-ctx.Done():
			return SandboxCost{}, nil, ctx.Err()
		}
		progress("%s: measuring %d idle sandboxes", label, len(sbxs))
		cost, err := sandboxCost(plat, sbxs, base)
		if err != nil {
			return cost, nil, err
		}
		progress("%s: %d execs on random sandboxes", label, cfg.ExecSamples)
		var lat []time.Duration
		rng := rand.New(rand.NewPCG(1, uint64(len(sbxs))))
		for range cfg.ExecSamples {
			s := sbxs[rng.IntN(len(sbxs))]
			t := time.Now()
			code, err := s.Exec(ctx, []string{"/bin/echo", "hello"}, sdk.RunOptions{})
			if err != nil || code != 0 {
				return cost, lat, fmt.Errorf("%s: exec: code %d, %v", label, code, err)
			}
			lat = append(lat, time.Since(t))
		}
		return cost, lat, nil
	}

	progress("low density: %d sandboxes", cfg.Low)
	if err := fill(cfg.Low); err != nil {
		return res, err
	}
	if len(sbxs) < cfg.Low {
		return res, fmt.Errorf("low density: %s", res.Stopped)
	}
	if res.Low, res.ExecLow, err = measure("low density"); err != nil {
		return res, err
	}
	progress("filling to %d sandboxes (%d clients)", cfg.Sandboxes, cfg.Clients)
	tc := time.Now()
	err = fill(cfg.Sandboxes)
	res.CreateWall = time.Since(tc)
	res.Reached = len(sbxs)
	if err != nil {
		return res, err
	}
	if res.Stopped != "" {
		progress("stopped at %d: %s", res.Reached, res.Stopped)
	}
	if res.High, res.ExecHigh, err = measure(fmt.Sprintf("%d sandboxes", res.Reached)); err != nil {
		return res, err
	}
	return res, nil
}

// procInfo is one process of the host.
type procInfo struct {
	pid, threads int
	pidns        string
}

// scanProcs lists every process with its thread count and pid namespace.
func scanProcs() []procInfo {
	ents, _ := os.ReadDir("/proc")
	var out []procInfo
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
		if err != nil {
			continue
		}
		out = append(out, procInfo{pid: pid, threads: procThreads(pid), pidns: ns})
	}
	return out
}

// sandboxCost measures every sandbox in sbxs: its spaced-host, netgtw (if
// started) and every process of its pid namespace (the agent is pid 1).
func sandboxCost(p *Platform, sbxs []*sdk.Sandbox, baseThreads int) (SandboxCost, error) {
	byNS := map[string][]procInfo{}
	for _, pi := range scanProcs() {
		byNS[pi.pidns] = append(byNS[pi.pidns], pi)
	}
	var tasks, procs, pss, hT, aT, hP, aP, aA, aF []float64
	for _, s := range sbxs {
		hp, gp, ok := p.BridgePID(s.ID)
		if !ok {
			return SandboxCost{}, fmt.Errorf("sandbox %s: no active bridge", s.ID)
		}
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", gp))
		if err != nil {
			return SandboxCost{}, fmt.Errorf("agent of %s: %w", s.ID, err)
		}
		members := []procInfo{{pid: hp, threads: procThreads(hp)}}
		for _, w := range p.Workers {
			if gw, ok := w.Manager().GatewayPID(s.ID); ok {
				members = append(members, procInfo{pid: gw, threads: procThreads(gw)})
			}
		}
		members = append(members, byNS[ns]...)
		var t, k int64
		for _, m := range members {
			t += int64(m.threads)
			mem, err := ReadProcMem(m.pid)
			if err != nil {
				return SandboxCost{}, fmt.Errorf("sandbox %s pid %d: %w", s.ID, m.pid, err)
			}
			k += mem.PSS
			switch m.pid {
			case hp:
				hT, hP = append(hT, float64(m.threads)), append(hP, float64(mem.PSS))
			case gp:
				aT, aP = append(aT, float64(m.threads)), append(aP, float64(mem.PSS))
				aA, aF = append(aA, float64(mem.RSSAnon)), append(aF, float64(mem.RSSFile))
			}
		}
		tasks, procs, pss = append(tasks, float64(t)), append(procs, float64(len(members))), append(pss, float64(k))
	}
	return SandboxCost{
		N: len(sbxs), Tasks: Median(tasks), Procs: Median(procs), PSSKiB: Median(pss),
		Worker:      float64(selfThreads()-baseThreads) / float64(len(sbxs)),
		HostThreads: Median(hT), AgentThreads: Median(aT), HostPSS: Median(hP), AgentPSS: Median(aP),
		AgentAnon: Median(aA), AgentFile: Median(aF),
		HostTasks: hostTasks(),
	}, nil
}

// procThreads is the Threads line of /proc/<pid>/status (0 if gone).
func procThreads(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for l := range bytes.Lines(b) {
		if v, ok := bytes.CutPrefix(l, []byte("Threads:")); ok {
			n, _ := strconv.Atoi(string(bytes.TrimSpace(v)))
			return n
		}
	}
	return 0
}

func selfThreads() int { return procThreads(os.Getpid()) }

// hostTasks is the number of tasks (threads) on the machine: the total
// of /proc/loadavg's running/total field.
func hostTasks() int {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 4 {
		return 0
	}
	_, total, _ := strings.Cut(f[3], "/")
	n, _ := strconv.Atoi(total)
	return n
}

func readInt(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// Rows renders the density run, each figure at the reached density beside
// the same at low density.
func (r *DensityResult) Rows() []Row {
	lo, hi := r.Low, r.High
	low := func(f string, a ...any) string { return fmt.Sprintf(f, a...) + fmt.Sprintf(" at %d", lo.N) }
	el, eh := ms(r.ExecLow), ms(r.ExecHigh)
	return []Row{
		{"idle ns sandboxes held on one host", strconv.Itoa(r.Reached), "-", "-", fmt.Sprintf(">= %d", r.Target), atLeast(float64(r.Reached), float64(r.Target))},
		{fmt.Sprintf("tasks/sandbox incl. worker, n=%d", hi.N), fmt.Sprintf("%.1f", hi.Tasks+hi.Worker), low("%.1f", lo.Tasks+lo.Worker), ratio(hi.Tasks+hi.Worker, lo.Tasks+lo.Worker), "", NotJudged},
		{fmt.Sprintf("processes/sandbox, n=%d", hi.N), fmt.Sprintf("%.1f", hi.Procs), low("%.1f", lo.Procs), ratio(hi.Procs, lo.Procs), "", NotJudged},
		{fmt.Sprintf("PSS/sandbox host+agent(+netgtw), n=%d (MiB)", hi.N), fmt.Sprintf("%.2f", mib(int64(hi.PSSKiB))), low("%.2f", mib(int64(lo.PSSKiB))), ratio(hi.PSSKiB, lo.PSSKiB), "<= 5 MiB", atMost(mib(int64(hi.PSSKiB)), 5)},
		{fmt.Sprintf("exec p50 at n=%d (ms)", hi.N), fmt.Sprintf("%.1f", Median(eh)), low("%.1f", Median(el)), ratio(Median(eh), Median(el)), "< 50 ms", atMost(Median(eh), 49.999)},
		{fmt.Sprintf("exec p99 at n=%d (ms)", hi.N), fmt.Sprintf("%.1f", Percentile(eh, 99)), low("%.1f", Percentile(el, 99)), ratio(Percentile(eh, 99), Percentile(el, 99)), "", NotJudged},
		{"host tasks / kernel.pid_max", fmt.Sprintf("%d / %d", hi.HostTasks, r.PidMax), low("%d", lo.HostTasks), "-", "", NotJudged},
	}
}

// Notes gives the breakdown and why the run stopped where it did.
func (r *DensityResult) Notes() string {
	var b strings.Builder
	for _, c := range []SandboxCost{r.Low, r.High} {
		fmt.Fprintf(&b, "n=%d: per sandbox (medians) spaced-host %.0f threads %.2f MiB PSS, agent %.0f threads %.2f MiB PSS (resident anon %.2f, file %.2f); sandbox tasks %.1f + worker %.2f; processes %.1f\n",
			c.N, c.HostThreads, mib(int64(c.HostPSS)), c.AgentThreads, mib(int64(c.AgentPSS)), mib(int64(c.AgentAnon)), mib(int64(c.AgentFile)), c.Tasks, c.Worker, c.Procs)
	}
	fmt.Fprintf(&b, "each sandbox used once (one exec) before measuring; netgtw starts only on a sandbox's first service-port request (none here).\n"+
		"exec = process.Process/Start of /bin/echo through edge -> node-api -> sbx-manager -> spaced-host -> agent, %d samples on random sandboxes at each density.\n"+
		"filling %d sandboxes took %.0fs with concurrent clients (each create followed by one exec).\n",
		len(r.ExecHigh), r.Reached-r.Low.N, r.CreateWall.Seconds())
	if r.Failures > 0 {
		fmt.Fprintf(&b, "%d creates or execs failed twice while filling (a failed create is replaced by another), e.g. %s\n", r.Failures, strings.Join(r.FailureSamples, "; "))
	}
	if r.Stopped != "" {
		fmt.Fprintf(&b, "stopped at %d of %d: %s\n", r.Reached, r.Target, r.Stopped)
	}
	if r.PidMax > 0 && r.High.N > 0 {
		per := r.High.Tasks + r.High.Worker
		fmt.Fprintf(&b, "kernel.pid_max %d holds about %d such sandboxes with %d tasks for everything else; more need a higher kernel.pid_max (space up warns at start).\n",
			r.PidMax, int(float64(r.PidMax-1024)/per), 1024)
	}
	return b.String()
}
