package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/node"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/sdk"
)

// CreateResult holds sandbox create latencies through the control plane
// and the raw substrate start latencies measured between them.
type CreateResult struct {
	Create   []time.Duration
	RawStart []time.Duration
	// BaseImage is what template base ran: the Debian base image's ID, or
	// "" when it ran the host's /usr (the image was not built).
	BaseImage string
	// HostBase are creates of template base-host (the host-/usr base),
	// each right after a create of base: the baseline of the Debian
	// image's cost. Empty when base itself ran the host's /usr.
	HostBase []time.Duration
	// Phases are the control plane's and the worker's per-phase timings
	// of the sequential creates (PhaseCollector), by phase name.
	Phases map[string][]time.Duration
	// Conc is the throughput run with concurrent clients.
	Conc ConcurrentCreateResult
	// ConcErr is why the throughput run failed, if it did.
	ConcErr error
}

// ConcurrentCreateResult is create throughput with Clients concurrent
// clients against raw ns starts at the same concurrency.
type ConcurrentCreateResult struct {
	Clients, Creates int
	// Wall is from the first create sent to the last answered.
	Wall time.Duration
	// Latency of each create under that load.
	Latency []time.Duration
	// RawStarts raw ns starts took RawWall with Clients at once.
	RawStarts int
	RawWall   time.Duration
	Phases    map[string][]time.Duration
}

// PerSecond is the create rate.
func (c ConcurrentCreateResult) PerSecond() float64 {
	if c.Wall <= 0 {
		return 0
	}
	return float64(c.Creates) / c.Wall.Seconds()
}

// RawPerSecond is the raw ns start rate.
func (c ConcurrentCreateResult) RawPerSecond() float64 {
	if c.RawWall <= 0 {
		return 0
	}
	return float64(c.RawStarts) / c.RawWall.Seconds()
}

// RawSubstrate starts bare ns sandboxes running the agent: no control
// plane, no etcd, no sbx-manager record, no spaced-host bridge.
type RawSubstrate struct {
	sub   *ns.Substrate
	dir   string
	agent string
	n     atomic.Int64
}

// NewRawSubstrate returns a substrate with its state under dir. Its
// cgroups live under "space-bench" so they never mix with a platform's.
func NewRawSubstrate(dir, binDir string, log *slog.Logger) (*RawSubstrate, error) {
	// The same init binary as the platforms' workers (node.NSInitPath).
	sub, err := ns.New(ns.Config{StateDir: filepath.Join(dir, "state"), CgroupParent: "space-bench", InitPath: node.NSInitPath(binDir), Logger: log})
	if err != nil {
		return nil, err
	}
	return &RawSubstrate{sub: sub, dir: dir, agent: filepath.Join(binDir, "spaced-guest")}, nil
}

// Close closes the substrate (stop every instance first).
func (r *RawSubstrate) Close() error { return r.sub.Close() }

func randID(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// StartStop starts one sandbox (template base), returns how long Start took
// and stops it.
func (r *RawSubstrate) StartStop(ctx context.Context) (time.Duration, error) {
	d, inst, err := r.start(ctx)
	if err != nil {
		return 0, err
	}
	return d, stopRaw(ctx, inst)
}

func stopRaw(ctx context.Context, inst substrate.Instance) error {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := inst.Stop(sctx); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	return nil
}

// start starts one sandbox (template base) and returns how long Start took.
func (r *RawSubstrate) start(ctx context.Context) (time.Duration, substrate.Instance, error) {
	n := r.n.Add(1)
	route := identity.Route{
		SandboxID: "rb" + randID(8), Generation: 1, ExecutionID: randID(12), WorkerID: "bench",
		Substrate: identity.SubstrateNS, ActivationID: randID(8),
	}
	gcfg, _ := json.Marshal(guest.Config{Identity: guest.Identity{
		Sandbox: route.SandboxID, Generation: 1, Execution: route.ExecutionID, Worker: route.WorkerID,
		Substrate: route.Substrate, Activation: route.ActivationID,
	}, DefaultUser: "user"})
	t0 := time.Now()
	inst, err := r.sub.Start(ctx, substrate.Spec{
		Route: route, Template: "base", Dir: filepath.Join(r.dir, fmt.Sprintf("a%d", n)), AgentPath: r.agent,
		AgentEnv: []string{"SPACE_GUEST_CONFIG=" + string(gcfg)},
	})
	d := time.Since(t0)
	if err != nil {
		return 0, nil, err
	}
	return d, inst, nil
}

// MeasureCreateConcurrent measures create throughput: clients goroutines
// create perClient sandboxes each through the control plane, as fast as
// they are answered (all are killed afterwards, untimed); then, as the
// baseline, the same number of raw ns starts with clients at once (all
// stopped afterwards, untimed).
func MeasureCreateConcurrent(ctx context.Context, p *Platform, raw *RawSubstrate, clients, perClient int) (ConcurrentCreateResult, error) {
	res := ConcurrentCreateResult{Clients: clients}
	var (
		mu   sync.Mutex
		sbxs []*sdk.Sandbox
		errs []error
		wg   sync.WaitGroup
	)
	defer func() {
		kctx := context.WithoutCancel(ctx)
		var kwg sync.WaitGroup
		sem := make(chan struct{}, 4)
		for _, s := range sbxs {
			kwg.Go(func() { sem <- struct{}{}; s.Kill(kctx); <-sem })
		}
		kwg.Wait()
	}()
	t0 := time.Now()
	for range clients {
		wg.Go(func() {
			for range perClient {
				c0 := time.Now()
				sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 5 * time.Minute})
				d := time.Since(c0)
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					sbxs = append(sbxs, sbx)
					res.Latency = append(res.Latency, d)
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	res.Wall = time.Since(t0)
	res.Creates = len(sbxs)
	if len(errs) > 0 {
		return res, fmt.Errorf("create (%d of %d failed): %w", len(errs), clients*perClient, errs[0])
	}
	if raw == nil {
		return res, nil
	}
	var insts []substrate.Instance
	t0 = time.Now()
	for range clients {
		wg.Go(func() {
			for range perClient {
				_, inst, err := raw.start(ctx)
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					insts = append(insts, inst)
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	res.RawWall = time.Since(t0)
	res.RawStarts = len(insts)
	for _, inst := range insts {
		if err := stopRaw(ctx, inst); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return res, fmt.Errorf("raw substrate start: %w", errs[0])
	}
	return res, nil
}

// MeasureCreate creates n sandboxes through the control plane's REST API
// one at a time, killing each right after (untimed) so the worker stays
// small; every rawEvery-th create is followed by a raw substrate start.
func MeasureCreate(ctx context.Context, p *Platform, raw *RawSubstrate, warmup, n, rawEvery int) (CreateResult, error) {
	var res CreateResult
	// The workers' choice for base (node.BaseImageAuto): the image when
	// it is built.
	if b, err := baseimage.Lookup(baseimage.Config{}); err == nil {
		res.BaseImage = b.ID
	}
	create := func(template string) (time.Duration, error) {
		t0 := time.Now()
		sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Template: template, Timeout: 5 * time.Minute})
		d := time.Since(t0)
		if err != nil {
			return 0, fmt.Errorf("create: %w", err)
		}
		if err := sbx.Kill(ctx); err != nil {
			return 0, fmt.Errorf("kill %s: %w", sbx.ID, err)
		}
		return d, nil
	}
	one := func() (time.Duration, error) { return create("") }
	host := func() (time.Duration, error) {
		if res.BaseImage == "" {
			return 0, nil
		}
		d, err := create(ns.TemplateBaseHost)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", ns.TemplateBaseHost, err)
		}
		return d, nil
	}
	for range warmup {
		if _, err := one(); err != nil {
			return res, err
		}
		if _, err := host(); err != nil {
			return res, err
		}
		if raw != nil {
			if _, err := raw.StartStop(ctx); err != nil {
				return res, fmt.Errorf("raw substrate start: %w", err)
			}
		}
	}
	for i := range n {
		d, err := one()
		if err != nil {
			return res, err
		}
		res.Create = append(res.Create, d)
		if d, err = host(); err != nil {
			return res, err
		} else if res.BaseImage != "" {
			res.HostBase = append(res.HostBase, d)
		}
		if raw != nil && rawEvery > 0 && i%rawEvery == 0 {
			d, err := raw.StartStop(ctx)
			if err != nil {
				return res, fmt.Errorf("raw substrate start: %w", err)
			}
			res.RawStart = append(res.RawStart, d)
		}
	}
	return res, nil
}

// errString shortens multi-line errors for the table.
func errString(err error) string {
	s := err.Error()
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 60 {
		s = s[:57] + "..."
	}
	return s
}
