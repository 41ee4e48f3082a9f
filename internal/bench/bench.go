// Package bench is `make bench` (cmd/space-bench): it measures SPACE's
// performance targets (issue 2) on a real single-machine platform and
// prints each figure beside a baseline measured in the same run, with
// medians and ratios rather than single timings, because the machine is
// shared and noisy.
//
// Figures: capability verification cold and cached against a raw Ed25519
// verify of a same-size message; a 4 KiB file read through the full path
// (edge -> node-api -> sbx-manager -> spaced-host -> guest) with identity
// checks on against a platform with them off; sandbox create latency
// through the control plane against a raw ns substrate start; and memory
// per idle sandbox (spaced-host + agent) against an idle minimal Go
// process; pause, resume and cross-worker resume on two workers; and the
// microvm substrate (template base-vm) against ns (template base) on that
// same platform: boot-to-ready, pause, resume, snapshot size and time,
// cross-worker resume and whether a process survives it (microvm.go).
//
// The hosting binary must call ns.MaybeInit first in main: the raw
// substrate baseline and the platforms start sandboxes by re-executing it.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/up"
)

// Config sizes a run.
type Config struct {
	// BinDir holds spaced-host and spaced-guest (make build).
	BinDir string
	// CapRounds rounds of CapColdPerRound distinct-token verifications and
	// CapCachedPerRound cache hits.
	CapRounds, CapColdPerRound, CapCachedPerRound int
	// ReadWarmup reads per side, then ReadRounds rounds of ReadPerRound
	// on/off read pairs.
	ReadWarmup, ReadRounds, ReadPerRound int
	// Creates through the control plane; a raw substrate start follows
	// every RawEvery-th create.
	CreateWarmup, Creates, RawEvery int
	// CreateClients concurrent clients create CreatesPerClient sandboxes
	// each (throughput), against raw ns starts at the same concurrency.
	CreateClients, CreatesPerClient int
	// Only, when "create", measures only sandbox creates (sequential and
	// concurrent) with their per-phase breakdown; "vm", "isolation",
	// "restart" and "serviceport" measure only that section.
	Only string
	// MemSandboxes idle sandboxes are measured after MemSettle.
	MemSandboxes int
	MemSettle    time.Duration
	// VM sizes the microvm section (base-vm vs base on the lifecycle
	// platform).
	VM VMConfig
	// VMIdle idle base-vm sandboxes are held on a one-worker platform for
	// their host memory (0: not measured).
	VMIdle int
	// IsoStarts raw ns starts and IsoIdle idle sandboxes per isolation
	// mode (user namespaces and disk quota on or off; isolation.go).
	IsoStarts, IsoIdle int
	// Readopt live sandboxes are held by a `space up` that is killed and
	// started again: the time until they all serve again (0: not
	// measured; readopt.go).
	Readopt int
	// EgressRounds rounds of the egress comparison (0: not measured;
	// egress.go).
	EgressRounds int
	// Fleet sizes the simulated-fleet section (fleet.go): the control
	// plane's creates/s and scheduling latency, 1 and 2 replicas.
	Fleet FleetConfig
	// Log receives progress (default stderr); platform logs at Error only.
	Log io.Writer
}

// DefaultConfig is what make bench runs (well under a minute on 2 cores).
func DefaultConfig() Config {
	return Config{
		CapRounds: 15, CapColdPerRound: 300, CapCachedPerRound: 50000,
		ReadWarmup: 50, ReadRounds: 20, ReadPerRound: 50,
		CreateWarmup: 2, Creates: 50, RawEvery: 2, CreateClients: 8, CreatesPerClient: 10,
		MemSandboxes: 10, MemSettle: 2 * time.Second,
		VM:     VMConfig{Creates: 5, NSPerVM: 2, BootBudget: 100 * time.Second, Rounds: 5, Snapshots: 2, Moves: 3},
		VMIdle: 50, IsoStarts: 40, IsoIdle: 10, Readopt: 100, EgressRounds: 5, Fleet: DefaultFleet(),
	}
}

// QuickConfig is a smoke run (seconds, not minutes).
func QuickConfig() Config {
	return Config{
		CapRounds: 3, CapColdPerRound: 50, CapCachedPerRound: 5000,
		ReadWarmup: 5, ReadRounds: 2, ReadPerRound: 10,
		CreateWarmup: 1, Creates: 5, RawEvery: 2, CreateClients: 8, CreatesPerClient: 2,
		MemSandboxes: 2, MemSettle: 500 * time.Millisecond,
		VM:     VMConfig{Creates: 1, NSPerVM: 1, Rounds: 1, Snapshots: 1, Moves: 1},
		VMIdle: 2, IsoStarts: 3, IsoIdle: 2, Readopt: 3, EgressRounds: 1, Fleet: QuickFleet(),
	}
}

// Report is everything a run measured.
type Report struct {
	Cap       CapResult
	CapErr    error
	Read      ReadResult
	ReadErr   error
	Create    CreateResult
	CreateErr error
	Mem       MemResult
	MemErr    error
	SP        ServicePortResult
	SPErr     error
	Life      LifecycleResult
	LifeErr   error
	VM        VMResult
	VMErr     error
	VMIdle    IdleVMResult
	VMIdleErr error
	Iso       IsolationResult
	IsoErr    error
	// Readopt is the restart of a worker holding live sandboxes.
	Readopt    ReadoptResult
	ReadoptErr error
	// Egress is a sandbox's connections out through the egress path
	// against the same client on the host (egress.go).
	Egress    EgressResult
	EgressErr error
	// Tpl is template build time, cold and cached.
	Tpl    TemplateResult
	TplErr error
	// CI is the code interpreter: runCode vs commands.run, create to the
	// first result (codeinterp.go).
	CI    CodeInterpResult
	CIErr error
	// Fleet is the control plane against simulated workers (fleet.go).
	Fleet    []FleetResult
	FleetErr error
	Took     time.Duration
}

// Run measures everything and writes the table and notes to out. A figure
// that fails is reported as such; Run returns an error if any did.
func Run(ctx context.Context, cfg Config, out io.Writer) error {
	if cfg.Log == nil {
		cfg.Log = os.Stderr
	}
	t0 := time.Now()
	progress := func(format string, a ...any) {
		fmt.Fprintf(cfg.Log, "[%5.1fs] %s\n", time.Since(t0).Seconds(), fmt.Sprintf(format, a...))
	}
	if cfg.Only == "fleet" { // fleet.go: no sandboxes, no binaries
		return runFleetOnly(ctx, cfg, out, progress, t0)
	}
	if cfg.BinDir == "" {
		return errors.New("bench: BinDir (SPACE_BIN_DIR) is required: run make bench")
	}
	var rep Report
	// The creates' per-phase timings come from the platform's own debug
	// records (control plane and worker); everything else at Error only.
	phases := NewPhaseCollector(discardLogger(cfg.Log).Handler(), slog.LevelError, map[string]string{
		controlplane.CreateTimingMsg: "api", sbxmanager.InstallTimingMsg: "worker"})
	switch cfg.Only {
	case "create":
		return runCreateOnly(ctx, cfg, out, phases, progress, t0)
	case "vm":
		return runVMOnly(ctx, cfg, out, progress, t0)
	case "isolation":
		return runIsolationOnly(ctx, cfg, out, progress, t0)
	case "restart":
		return runRestartOnly(ctx, cfg, out, progress, t0)
	case "egress":
		return runEgressOnly(ctx, cfg, out, progress, t0)
	case "serviceport":
		return runServicePortOnly(ctx, cfg, out, progress, t0)
	case "template":
		return runTemplateOnly(ctx, cfg, out, progress, t0)
	case "codeinterp":
		return runCodeInterpOnly(ctx, cfg, out, progress, t0)
	case "tracing": // tracing.go
		return runTracingOnly(ctx, cfg, out, progress, t0)
	}

	// 1. Capability verification first, while no platform competes for CPU.
	progress("capability verify: %d rounds x %d cold, %d cached", cfg.CapRounds, cfg.CapColdPerRound, cfg.CapCachedPerRound)
	rep.Cap, rep.CapErr = MeasureCapability(cfg.CapRounds, cfg.CapColdPerRound, cfg.CapCachedPerRound)

	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	plog := discardLogger(cfg.Log)

	// 2. Both platforms at once (own ports, data dirs, worker state).
	progress("starting two platforms (identity checks on / off)")
	var on, off *Platform
	var onErr, offErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		on, onErr = StartPlatform(ctx, cfg.BinDir, platformDir(root, "on"), 1, false, slog.New(phases))
	})
	wg.Go(func() { off, offErr = StartPlatform(ctx, cfg.BinDir, platformDir(root, "off"), 1, true, plog) })
	wg.Wait()
	closeOff := func() {
		if off != nil {
			off.Close()
			off = nil
		}
	}
	closeOn := func() {
		if on != nil {
			on.Close()
			on = nil
		}
	}
	defer closeOff()
	defer closeOn()
	if err := errors.Join(onErr, offErr); err != nil {
		rep.ReadErr, rep.CreateErr, rep.MemErr = err, err, err
	} else {
		progress("4 KiB read: %d warm-up + %d rounds x %d on/off pairs", cfg.ReadWarmup, cfg.ReadRounds, cfg.ReadPerRound)
		rep.Read, rep.ReadErr = MeasureRead(ctx, on, off, cfg.ReadWarmup, cfg.ReadRounds, cfg.ReadPerRound)
		closeOff()

		rep.Create, rep.CreateErr = measureCreates(ctx, cfg, on, root, phases, progress)

		progress("memory: %d idle sandboxes", cfg.MemSandboxes)
		rep.Mem, rep.MemErr = MeasureMemory(ctx, on, cfg.MemSandboxes, cfg.MemSettle)

		progress("service port: HTTP through edge+netgtw vs direct, connections per second")
		rep.SP, rep.SPErr = MeasureServicePort(ctx, on, 300, 3*time.Second)

		progress("template builds: 3 rounds of a 3-step template, cold then cached")
		rep.Tpl, rep.TplErr = MeasureTemplateBuild(ctx, on, 3)

		progress("code interpreter: 3 creates to the first result, 100 runCode('1+1') / commands.run('python3 -c 1') pairs")
		rep.CI, rep.CIErr = MeasureCodeInterp(ctx, on, "code-interpreter-v1", 3, 100)
	}
	closeOff()
	closeOn()

	progress("isolation: %d ns starts and %d idle sandboxes per mode (userns+quota, quota only, neither)", cfg.IsoStarts, cfg.IsoIdle)
	rep.Iso, rep.IsoErr = MeasureIsolation(ctx, filepath.Join(root, "iso"), cfg.BinDir, plog, cfg.IsoStarts, cfg.IsoIdle, cfg.MemSettle)

	measureLifeAndVM(ctx, cfg, root, plog, progress, &rep, true)
	if cfg.Readopt > 0 {
		progress("restart: %d live sandboxes, space up killed and started again", cfg.Readopt)
		rep.Readopt, rep.ReadoptErr = MeasureReadopt(ctx, cfg.BinDir, platformDir(root, "readopt"), cfg.Readopt)
	}
	if cfg.EgressRounds > 0 {
		progress("egress: %d rounds of netprobe in a sandbox vs on the host", cfg.EgressRounds)
		rep.Egress, rep.EgressErr = MeasureEgress(ctx, cfg.BinDir, platformDir(root, "egress"), cfg.EgressRounds, plog)
	}
	if len(cfg.Fleet.Replicas) > 0 {
		rep.Fleet, rep.FleetErr = MeasureFleet(ctx, root, cfg.Fleet, cfg.Log, progress)
	}
	rep.Took = time.Since(t0)
	progress("done")
	fmt.Fprintln(out)
	if err := WriteTable(out, rep.Rows()); err != nil {
		return err
	}
	fmt.Fprintln(out)
	fmt.Fprint(out, rep.Notes())
	return errors.Join(rep.CapErr, rep.ReadErr, rep.CreateErr, rep.MemErr, rep.SPErr, rep.IsoErr, rep.LifeErr, rep.VMErr, rep.VMIdleErr, rep.ReadoptErr, rep.EgressErr, rep.TplErr, rep.CIErr, rep.FleetErr)
}

// runEgressOnly measures only the egress path (-only egress).
func runEgressOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("egress: %d rounds of netprobe in a sandbox vs on the host", cfg.EgressRounds)
	r, err := MeasureEgress(ctx, cfg.BinDir, platformDir(root, "egress"), max(cfg.EgressRounds, 1), discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	progress("done")
	fmt.Fprintln(out)
	if err := WriteTable(out, r.Rows()); err != nil {
		return err
	}
	fmt.Fprintf(out, "\n%d rounds (medians over rounds), %d probe errors; took %s\n", r.Rounds, r.Errors, time.Since(t0).Round(time.Second))
	return nil
}

// runRestartOnly measures only what a restart costs (-only restart): a
// worker holding cfg.Readopt live sandboxes killed and started again
// (re-adoption), and sandboxes whose init died (recovery), each beside
// the creates of its own run.
func runRestartOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	var rows []Row
	progress("restart: %d live sandboxes, space up killed and started again", cfg.Readopt)
	if ro, err := MeasureReadopt(ctx, cfg.BinDir, platformDir(root, "readopt"), cfg.Readopt); err != nil {
		rows = append(rows, Row{Figure: "worker start to serving again (re-adoption)", Value: "error: " + errString(err)})
	} else {
		rows = append(rows, ro.Rows()...)
	}
	progress("recovery: %d sandboxes whose init is killed", recoveries)
	p, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "recovery"), 1, false, discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	var lr LifecycleResult
	for range recoveries {
		c, r, err := measureRecovery(ctx, p)
		if err != nil {
			p.Close()
			return fmt.Errorf("recovery: %w", err)
		}
		lr.Create, lr.Recover = append(lr.Create, c), append(lr.Recover, r)
	}
	p.Close()
	rows = append(rows, lr.recoveryRows()...)
	progress("done")
	fmt.Fprintln(out)
	if err := WriteTable(out, rows); err != nil {
		return err
	}
	fmt.Fprintf(out, "\ntook %s\n", time.Since(t0).Round(time.Second))
	return nil
}

// runServicePortOnly measures only the service-port section (-only
// serviceport) on a platform of its own.
func runServicePortOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("starting a platform")
	p, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "sp"), 1, false, discardLogger(cfg.Log))
	if err != nil {
		return err
	}
	defer p.Close()
	progress("service port: HTTP through edge+netgtw vs direct, connections per second")
	res, err := MeasureServicePort(ctx, p, 300, 3*time.Second)
	progress("done in %s", time.Since(t0).Round(time.Second))
	if err != nil {
		return err
	}
	fmt.Fprintln(out)
	return WriteTable(out, res.Rows())
}

// runIsolationOnly measures only the isolation section (-only isolation).
func runIsolationOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	progress("isolation: %d ns starts and %d idle sandboxes per mode (userns+quota, quota only, neither)", cfg.IsoStarts, cfg.IsoIdle)
	res, err := MeasureIsolation(ctx, root, cfg.BinDir, discardLogger(cfg.Log), cfg.IsoStarts, cfg.IsoIdle, cfg.MemSettle)
	progress("done in %s", time.Since(t0).Round(time.Second))
	if err != nil {
		return err
	}
	fmt.Fprintln(out)
	return WriteTable(out, res.rows())
}

// measureLifeAndVM runs, each on platforms of its own, alone on the
// machine: the lifecycle section (when lifecycle is set) and the microvm
// section on a platform of two workers, the cold-boot baseline on a
// platform without template snapshots, and the idle-VM memory on one
// worker.
func measureLifeAndVM(ctx context.Context, cfg Config, root string, plog *slog.Logger, progress func(string, ...any), rep *Report, lifecycle bool) {
	if lifecycle {
		progress("lifecycle: pause/resume x10, cross-worker resume x5 at %v MiB, recovery after an init death x%d", lifecycleLayers, recoveries)
	}
	if life, err := StartPlatformConfig(ctx, up.Config{DataDir: platformDir(root, "life"), Workers: 2, BinDir: cfg.BinDir, Logger: plog, VMPrewarm: true}); err != nil {
		rep.LifeErr, rep.VMErr = err, err
	} else {
		if lifecycle {
			rep.Life, rep.LifeErr = MeasureLifecycle(ctx, life, 10, 5, lifecycleLayers)
		}
		// The microvm section on the same platform, each figure beside ns;
		// cold boots on a platform without template snapshots.
		vc := cfg.VM
		cold, err := StartPlatformConfig(ctx, up.Config{DataDir: platformDir(root, "cold"), Workers: 1, BinDir: cfg.BinDir, Logger: plog, VMNoTemplates: true})
		if err != nil {
			rep.VMErr = fmt.Errorf("cold-boot platform: %w", err)
		} else {
			vc.Cold = cold
			rep.VM, rep.VMErr = MeasureVM(ctx, life, cfg.BinDir, vc, progress)
			cold.Close()
		}
		life.Close() // before printing: etcd logs its shutdown on stderr
	}
	if cfg.VMIdle > 0 && rep.VMErr == nil && rep.VM.Skipped == "" {
		progress("microvm: %d idle base-vm sandboxes on one worker", cfg.VMIdle)
		if p, err := StartPlatformConfig(ctx, up.Config{DataDir: platformDir(root, "vmidle"), Workers: 1, BinDir: cfg.BinDir, Logger: plog,
			VMPrewarm: true, Capacity: cfg.VMIdle + 10}); err != nil {
			rep.VMIdleErr = err
		} else {
			rep.VMIdle, rep.VMIdleErr = MeasureIdleVMs(ctx, p, cfg.VMIdle, progress)
			p.Close()
		}
	}
}

// runVMOnly is Run for Config.Only == "vm": the microvm section and the
// idle-VM memory, nothing else.
func runVMOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	var rep Report
	measureLifeAndVM(ctx, cfg, root, discardLogger(cfg.Log), progress, &rep, false)
	rep.Took = time.Since(t0)
	progress("done")
	var rows []Row
	if rep.VMErr != nil {
		rows = append(rows, Row{Figure: "microvm (base-vm) vs ns (base)", Value: "error: " + errString(rep.VMErr)})
	} else {
		rows = append(rows, rep.VM.Rows()...)
	}
	if rep.VMIdleErr != nil {
		rows = append(rows, Row{Figure: "microvm idle base-vm memory", Value: "error: " + errString(rep.VMIdleErr)})
	} else if rep.VMIdle.N > 0 {
		rows = append(rows, rep.VMIdle.Rows()...)
	}
	fmt.Fprintln(out)
	if err := WriteTable(out, rows); err != nil {
		return err
	}
	fmt.Fprintln(out)
	if rep.VMErr == nil {
		fmt.Fprint(out, rep.VM.Notes())
	}
	if rep.VMIdleErr == nil && rep.VMIdle.N > 0 {
		fmt.Fprint(out, rep.VMIdle.Notes())
	}
	return errors.Join(rep.VMErr, rep.VMIdleErr)
}

// measureCreates runs the sequential creates (latency, beside raw ns
// starts) and then the concurrent ones (throughput), each with its
// per-phase breakdown.
func measureCreates(ctx context.Context, cfg Config, on *Platform, root string, phases *PhaseCollector, progress func(string, ...any)) (CreateResult, error) {
	progress("create: %d creates through the control plane, raw substrate start every %d", cfg.Creates, cfg.RawEvery)
	raw, err := NewRawSubstrate(platformDir(root, "raw"), cfg.BinDir, discardLogger(cfg.Log))
	if err != nil {
		progress("raw substrate baseline unavailable: %v", err)
		raw = nil
	}
	defer func() {
		if raw != nil {
			raw.Close()
		}
	}()
	phases.Collect(true)
	res, err := MeasureCreate(ctx, on, raw, cfg.CreateWarmup, cfg.Creates, cfg.RawEvery)
	res.Phases = phases.Phases()
	if err != nil {
		return res, err
	}
	if cfg.CreateClients > 0 && cfg.CreatesPerClient > 0 {
		progress("create throughput: %d clients x %d creates, then raw ns starts at the same concurrency", cfg.CreateClients, cfg.CreatesPerClient)
		phases.Collect(true)
		res.Conc, res.ConcErr = MeasureCreateConcurrent(ctx, on, raw, cfg.CreateClients, cfg.CreatesPerClient)
		res.Conc.Phases = phases.Phases()
	}
	phases.Collect(false)
	return res, nil
}

// runCreateOnly is Run for Config.Only == "create".
func runCreateOnly(ctx context.Context, cfg Config, out io.Writer, phases *PhaseCollector, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	var rep Report
	progress("starting a platform")
	on, err := StartPlatform(ctx, cfg.BinDir, platformDir(root, "on"), 1, false, slog.New(phases))
	if err != nil {
		return err
	}
	rep.Create, rep.CreateErr = measureCreates(ctx, cfg, on, root, phases, progress)
	on.Close()
	rep.Took = time.Since(t0)
	progress("done")
	fmt.Fprintln(out)
	rows := rep.createRows()
	if err := WriteTable(out, rows); err != nil {
		return err
	}
	fmt.Fprintln(out)
	fmt.Fprint(out, rep.createNotes())
	return errors.Join(rep.CreateErr, rep.Create.ConcErr)
}

// lifecycleLayers are the writable-layer sizes (MiB) cross-worker resume is
// measured at.
var lifecycleLayers = []int{1, 100}
