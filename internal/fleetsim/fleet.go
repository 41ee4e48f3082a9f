// Package fleetsim is a simulated fleet of workers in one process, to
// measure the control plane itself (space-bench -only fleet). Each
// simulated worker registers through the store under a lease of its own
// and keeps it alive, watches the key bundle, and serves node-api's control
// calls (install, teardown, pause, resume, retire, snapshot, network,
// metrics, agent log, health) on a listener of its own: every call is
// decoded and its control capability verified by node-api's own code
// (nodeapi.ControlHandler: signature against the watched bundle, purpose,
// worker, exactly the route in the body), and answered with the bodies a
// real worker gives, from an in-memory table of executions. Nothing runs:
// no sandbox, no record on disk, no data plane (its requests get 404).
package fleetsim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/store"
)

// Defaults.
const (
	DefaultWorkers      = 100
	DefaultIDPrefix     = "sim-"
	DefaultHost         = "127.0.0.1"
	DefaultCapacity     = 1000
	DefaultLeaseTTL     = 10 * time.Second
	DefaultBundleWait   = 15 * time.Second
	DefaultLoadInterval = 5 * time.Second
	DefaultEnvdVersion  = "0.2.0"
)

// Config sizes and shapes a fleet.
type Config struct {
	// Workers is the number of simulated workers (default 100).
	Workers int
	// IDPrefix names them: worker i is IDPrefix + i in three digits
	// (default "sim-": sim-000, sim-001, ...).
	IDPrefix string
	// Host is the address each worker's node-api listens on, on a port of
	// its own (default 127.0.0.1).
	Host string
	// Capacity is each worker's advertised capacity (default 1000).
	Capacity int
	// Substrates each worker advertises and accepts installs of (default
	// ns).
	Substrates []string
	// LeaseTTL is each registration's lease (default 10 s).
	LeaseTTL time.Duration
	// BundleWait bounds waiting for the first key bundle (default 15 s);
	// a worker registers only once it has one, as a real one does.
	BundleWait time.Duration
	// LoadInterval is how often each worker reports its load (executions
	// installed) in its registration, when it changed (default 5 s;
	// negative: never, as a real worker, whose load the control plane
	// counts from its records).
	LoadInterval time.Duration
	// InstallDelay is added to every install, CallDelay to every other
	// control call (default 0: answered at once).
	InstallDelay, CallDelay time.Duration
	// EnvdVersion is what installs answer (default "0.2.0").
	EnvdVersion string
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Workers <= 0 {
		c.Workers = DefaultWorkers
	}
	if c.IDPrefix == "" {
		c.IDPrefix = DefaultIDPrefix
	}
	if c.Host == "" {
		c.Host = DefaultHost
	}
	if c.Capacity <= 0 {
		c.Capacity = DefaultCapacity
	}
	if len(c.Substrates) == 0 {
		c.Substrates = []string{identity.SubstrateNS}
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.BundleWait <= 0 {
		c.BundleWait = DefaultBundleWait
	}
	if c.LoadInterval == 0 {
		c.LoadInterval = DefaultLoadInterval
	}
	if c.EnvdVersion == "" {
		c.EnvdVersion = DefaultEnvdVersion
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks c; zero fields take their defaults in New.
func (c Config) Validate() error {
	switch {
	case c.Workers > 10000:
		return fmt.Errorf("fleetsim: %w: at most 10000 workers", errdefs.ErrInvalid)
	case c.LeaseTTL != 0 && c.LeaseTTL < store.MinWorkerTTL:
		return fmt.Errorf("fleetsim: %w: lease ttl %s below %s", errdefs.ErrInvalid, c.LeaseTTL, store.MinWorkerTTL)
	case c.InstallDelay < 0 || c.CallDelay < 0:
		return fmt.Errorf("fleetsim: %w: negative delay", errdefs.ErrInvalid)
	}
	for _, s := range c.Substrates {
		if !identity.KnownSubstrate(s) {
			return fmt.Errorf("fleetsim: %w: unknown substrate %q", errdefs.ErrInvalid, s)
		}
	}
	return nil
}

// Deps are the fleet's collaborators.
type Deps struct {
	// Store registers the workers and delivers the key bundle. Required;
	// the caller closes it after the fleet.
	Store *store.Store
}

// Fleet is a running set of simulated workers.
type Fleet struct {
	cfg     Config
	st      *store.Store
	log     *slog.Logger
	workers []*Worker
	byID    map[string]*Worker

	ready     chan struct{}
	readyOnce sync.Once
	nReady    chan struct{} // one token per registered worker

	mu      sync.Mutex
	running bool
	wg      sync.WaitGroup
	cancel  context.CancelFunc
	closed  bool
}

// New binds every worker's listener; Run starts them.
func New(cfg Config, deps Deps) (*Fleet, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if deps.Store == nil {
		return nil, fmt.Errorf("fleetsim: %w: a store is required", errdefs.ErrInvalid)
	}
	f := &Fleet{cfg: cfg, st: deps.Store, log: cfg.Logger.With("component", "fleetsim"), byID: map[string]*Worker{},
		ready: make(chan struct{}), nReady: make(chan struct{}, cfg.Workers)}
	for i := range cfg.Workers {
		w, err := newWorker(f, fmt.Sprintf("%s%03d", cfg.IDPrefix, i))
		if err != nil {
			f.closeListeners()
			return nil, err
		}
		f.workers = append(f.workers, w)
		f.byID[w.id] = w
	}
	return f, nil
}

// Run starts every worker (bundle watch, node-api, registration once the
// first bundle is in, load reports) and blocks until ctx ends, then stops
// them all: each deregisters (its lease revoked) and stops serving. It
// returns the first worker's error, if any failed (e.g. no key bundle in
// BundleWait); the others keep running until ctx ends.
func (f *Fleet) Run(ctx context.Context) error {
	f.mu.Lock()
	if f.running || f.closed {
		f.mu.Unlock()
		return fmt.Errorf("fleetsim: %w: run once, before Close", errdefs.ErrConflict)
	}
	f.running = true
	ctx, cancel := context.WithCancel(ctx)
	f.cancel = cancel
	f.wg.Add(1) // Close waits for Run
	f.mu.Unlock()
	defer f.wg.Done()
	defer cancel()

	errs := make(chan error, len(f.workers))
	var wg sync.WaitGroup
	for _, w := range f.workers {
		wg.Go(func() {
			if err := w.run(ctx); err != nil {
				errs <- err
			}
		})
	}
	wg.Go(func() {
		for range f.workers {
			select {
			case <-f.nReady:
			case <-ctx.Done():
				return
			}
		}
		f.readyOnce.Do(func() { close(f.ready) })
	})
	wg.Wait()
	close(errs)
	return <-errs
}

// registered is called by each worker once it is registered.
func (f *Fleet) registered() { f.nReady <- struct{}{} }

// Ready is closed once every worker has registered.
func (f *Fleet) Ready() <-chan struct{} { return f.ready }

// WaitReady waits until every worker has registered or ctx ends.
func (f *Fleet) WaitReady(ctx context.Context) error {
	select {
	case <-f.ready:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("fleetsim: %w: fleet not registered: %v", errdefs.ErrUnavailable, ctx.Err())
	}
}

// IDs are the workers' ids in order.
func (f *Fleet) IDs() []string {
	out := make([]string, len(f.workers))
	for i, w := range f.workers {
		out[i] = w.id
	}
	return out
}

// Worker returns one worker by id (nil when there is none).
func (f *Fleet) Worker(id string) *Worker { return f.byID[id] }

// Remove takes a worker out of the fleet: it deregisters (its lease is
// revoked, so the entry is gone at once) and stops serving. It is not
// restarted.
func (f *Fleet) Remove(ctx context.Context, id string) error {
	w := f.byID[id]
	if w == nil {
		return fmt.Errorf("fleetsim: worker %q: %w", id, errdefs.ErrNotFound)
	}
	return w.stop(ctx)
}

// Stats are every worker's counters, in order.
func (f *Fleet) Stats() []Stats {
	out := make([]Stats, len(f.workers))
	for i, w := range f.workers {
		out[i] = w.Stats()
	}
	return out
}

// Close stops the fleet (as ctx's end does for Run) and waits for Run to
// return. Listeners of a fleet that never ran are closed.
func (f *Fleet) Close() error {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil
	}
	f.closed = true
	running, cancel := f.running, f.cancel
	f.mu.Unlock()
	if running {
		cancel()
		f.wg.Wait()
		return nil
	}
	f.closeListeners()
	return nil
}

func (f *Fleet) closeListeners() {
	var errs []error
	for _, w := range f.workers {
		errs = append(errs, w.ln.Close())
	}
	if err := errors.Join(errs...); err != nil {
		f.log.Debug("closing listeners", "err", err)
	}
}
