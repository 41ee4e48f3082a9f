package bench

// -only fleet (and make bench): the control plane itself, against a
// simulated fleet (internal/fleetsim) of 100 workers on embedded etcd, with
// one control-plane replica and with two (two controlplane.Server on the
// same etcd, each with a store client of its own; the load client sends
// request i to replica i mod n). Concurrent clients create sandboxes
// through the E2B REST API (POST /sandboxes with the API key) in rounds;
// each round's rate is its creates over its wall time, and the figure is
// the median over rounds. The sandboxes of a round are killed (untimed)
// before the next, so every round sees the tombstones of the ones before.
// Scheduling latency is the control plane's own: a create's arrival to its
// placement decision (the "schedule" duration of its create timing
// record, the space_api_schedule_seconds histogram's samples).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/controlplane"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/fleetsim"
	"github.com/spacesbx/space/internal/store"
)

// FleetConfig sizes the fleet section.
type FleetConfig struct {
	// Workers simulated workers (100), Clients concurrent clients,
	// Rounds rounds of Creates creates each, per replica count.
	Workers, Clients, Rounds, Creates int
	// Replicas are the control-plane replica counts measured (1, 2).
	Replicas []int
}

// DefaultFleet is make bench's fleet section.
func DefaultFleet() FleetConfig {
	return FleetConfig{Workers: 100, Clients: 16, Rounds: 5, Creates: 300, Replicas: []int{1, 2}}
}

// QuickFleet is a smoke run.
func QuickFleet() FleetConfig {
	return FleetConfig{Workers: 100, Clients: 8, Rounds: 2, Creates: 40, Replicas: []int{1, 2}}
}

// FleetResult is one replica count's measurement.
type FleetResult struct {
	Replicas, Workers, Clients int
	// Rates are the creates per second of each round.
	Rates []float64
	// Schedule is every create's arrival-to-placement time (control
	// plane); Latency every create's end-to-end time (client).
	Schedule, Latency []time.Duration
	// MinPerWorker and MaxPerWorker are the fewest and most installs any
	// worker got over the run (spread).
	MinPerWorker, MaxPerWorker int64
	// Denied control calls on the fleet (must be 0).
	Denied int64
	// Phases are the creates' create-timing phases (api.place, ...).
	Phases map[string][]time.Duration
	// Floors are the store floor's rates, one round before each create
	// round: the same clients doing only a create's etcd operations
	// (FleetEnv.FloorRound), the baseline of the creates' rate.
	Floors []float64
}

// Median creates per second over rounds.
func (r FleetResult) Median() float64 { return Median(r.Rates) }

// MeasureFleet measures each replica count in fc.Replicas on a fresh
// etcd and fleet under root.
func MeasureFleet(ctx context.Context, root string, fc FleetConfig, logw io.Writer, progress func(string, ...any)) ([]FleetResult, error) {
	var out []FleetResult
	for _, n := range fc.Replicas {
		progress("fleet: %d simulated workers, %d control plane(s), %d clients, %d rounds x %d creates", fc.Workers, n, fc.Clients, fc.Rounds, fc.Creates)
		r, err := measureFleetOnce(ctx, filepath.Join(root, fmt.Sprintf("fleet-%d", n)), fc, n, logw)
		if err != nil {
			return out, fmt.Errorf("%d replica(s): %w", n, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func measureFleetOnce(ctx context.Context, dir string, fc FleetConfig, replicas int, logw io.Writer) (FleetResult, error) {
	res := FleetResult{Replicas: replicas, Workers: fc.Workers, Clients: fc.Clients, Phases: map[string][]time.Duration{}}
	env, err := StartFleet(ctx, dir, fc.Workers, replicas, fc.Clients, logw)
	if err != nil {
		return res, err
	}
	defer env.Close()
	// Warm-up: connections, the first key bundle lookups.
	if _, err := env.Round(ctx, fc.Clients, nil); err != nil {
		return res, fmt.Errorf("warm-up: %w", err)
	}
	for range fc.Rounds {
		f, err := env.FloorRound(ctx, fc.Creates)
		if err != nil {
			return res, fmt.Errorf("store floor: %w", err)
		}
		res.Floors = append(res.Floors, f)
		env.phases.Collect(true)
		r, err := env.Round(ctx, fc.Creates, &res.Latency)
		env.phases.Collect(false)
		if err != nil {
			return res, err
		}
		res.Rates = append(res.Rates, r)
		for k, v := range env.phases.Phases() {
			res.Phases[k] = append(res.Phases[k], v...)
		}
	}
	res.Schedule = res.Phases["api.schedule"]
	st0 := env.fleet.Stats()
	res.MinPerWorker = st0[0].Installs
	for _, s := range st0 {
		res.MinPerWorker, res.MaxPerWorker = min(res.MinPerWorker, s.Installs), max(res.MaxPerWorker, s.Installs)
		res.Denied += s.Denied
	}
	if res.Denied > 0 {
		return res, fmt.Errorf("the fleet denied %d control calls", res.Denied)
	}
	return res, nil
}

// FleetEnv is embedded etcd, control-plane replicas serving on loopback
// and a simulated fleet, with a load client over the replicas.
type FleetEnv struct {
	*loadClient
	st     *store.Store
	fleet  *fleetsim.Fleet
	phases *PhaseCollector
	undo   []func()
}

// Close stops everything StartFleet started, in reverse order.
func (e *FleetEnv) Close() {
	for i := len(e.undo) - 1; i >= 0; i-- {
		e.undo[i]()
	}
	e.undo = nil
}

// StartFleet starts embedded etcd under dir, replicas control planes (the
// first on the embedded etcd's client, each other with a client of its
// own) and workers simulated workers, and waits until they are registered.
func StartFleet(ctx context.Context, dir string, workers, replicas, clients int, logw io.Writer) (_ *FleetEnv, err error) {
	e := &FleetEnv{phases: NewPhaseCollector(discardLogger(logw).Handler(), slog.LevelError, map[string]string{controlplane.CreateTimingMsg: "api"})}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	log, plog := slog.New(e.phases), discardLogger(logw)
	octx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	st, err := store.Open(octx, store.Config{DataDir: filepath.Join(dir, "etcd"), Logger: plog})
	if err != nil {
		return nil, err
	}
	e.undo = append(e.undo, func() { st.Close() })
	e.st = st
	runCtx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	e.undo = append(e.undo, func() { stop(); wg.Wait() })
	key := "e2b_" + strings.Repeat("0f", 20)
	var urls []string
	for i := range replicas {
		rst := st
		if i > 0 { // a replica of its own: its own etcd client
			if rst, err = store.Open(octx, store.Config{Endpoints: st.Endpoints(), Logger: plog}); err != nil {
				return nil, err
			}
			e.undo = append(e.undo, func() { rst.Close() })
		}
		cp, err := controlplane.New(controlplane.Config{DataDir: filepath.Join(dir, fmt.Sprintf("cp%d", i)), BootstrapAPIKey: key},
			controlplane.Deps{Store: rst, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("control plane %d: %w", i, err)
		}
		e.undo = append(e.undo, func() { cp.Close() })
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		urls = append(urls, "http://"+ln.Addr().String())
		served := make(chan struct{})
		wg.Go(func() { defer close(served); _ = cp.Serve(runCtx, ln) })
		e.undo = append(e.undo, func() { stop(); <-served }) // before cp.Close
	}
	e.fleet, err = fleetsim.New(fleetsim.Config{Workers: workers, Logger: plog}, fleetsim.Deps{Store: st})
	if err != nil {
		return nil, err
	}
	fleetDone := make(chan struct{})
	wg.Go(func() { defer close(fleetDone); _ = e.fleet.Run(runCtx) })
	e.undo = append(e.undo, func() { e.fleet.Close(); <-fleetDone })
	if err := e.fleet.WaitReady(octx); err != nil {
		return nil, err
	}
	e.loadClient = newLoadClient(urls, key, clients)
	e.undo = append(e.undo, e.loadClient.close)
	return e, nil
}

// FloorRound is the store's floor under a create: n times, by as many
// clients as the creates, the etcd operations a create waits for in turn
// (the API key's lookup, the record's create, its update to running), on
// the same etcd, without HTTP, control plane or worker. The records
// (killed ones, placed nowhere) are deleted untimed. It returns the rate.
func (e *FleetEnv) FloorRound(ctx context.Context, n int) (float64, error) {
	h := store.HashAPIKey(e.key)
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var (
		mu   sync.Mutex
		errs []error
		ids  []string
		wg   sync.WaitGroup
	)
	t0 := time.Now()
	for range e.clients {
		wg.Go(func() {
			for range next {
				id := "f" + randHex(19)
				rec := store.SandboxRecord{ID: id, TeamID: "bench-floor", TemplateID: "base", State: store.StateKilled, CreatedAt: time.Now().UTC(), EndedAt: time.Now().UTC()}
				_, _, err := e.st.LookupAPIKeyRev(ctx, h)
				var rev int64
				if err == nil {
					rev, err = e.st.CreateSandbox(ctx, rec)
				}
				if err == nil {
					rec.Reason = "floor"
					_, err = e.st.UpdateSandbox(ctx, id, rev, rec)
				}
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					ids = append(ids, id)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	wall := time.Since(t0)
	for _, id := range ids {
		if err := e.st.DeleteSandbox(ctx, id, 0); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return 0, fmt.Errorf("%d failed, first: %w", len(errs), errs[0])
	}
	return float64(n) / wall.Seconds(), nil
}

func randHex(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

// loadClient spreads creates and kills over the control planes.
type loadClient struct {
	urls    []string
	key     string
	clients int
	hc      *http.Client
}

func newLoadClient(urls []string, key string, clients int) *loadClient {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = clients
	return &loadClient{urls: urls, key: key, clients: clients, hc: &http.Client{Transport: tr, Timeout: time.Minute}}
}

func (l *loadClient) close() { l.hc.CloseIdleConnections() }

func (l *loadClient) do(ctx context.Context, method, url string, body []byte, want int) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", l.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := l.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != want {
		err = fmt.Errorf("%s %s: %d %s", method, url, resp.StatusCode, bytes.TrimSpace(b))
	}
	return b, err
}

// Round creates n sandboxes with l.clients clients (request i to control
// plane i mod len(urls)), appending each create's latency to lat (when
// set), then kills them all (untimed), each through the next control
// plane (with two: the other replica, whose signature the worker checks). It returns the creates per second.
func (l *loadClient) Round(ctx context.Context, n int, lat *[]time.Duration) (float64, error) {
	body := []byte(`{"templateID":"base"}`)
	ids := make([]string, n)
	durs := make([]time.Duration, n)
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	t0 := time.Now()
	for range l.clients {
		wg.Go(func() {
			for i := range next {
				t := time.Now()
				b, err := l.do(ctx, "POST", l.urls[i%len(l.urls)]+"/sandboxes", body, http.StatusCreated)
				durs[i] = time.Since(t)
				var sb e2bapi.Sandbox
				if err == nil {
					err = json.Unmarshal(b, &sb)
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					continue
				}
				ids[i] = sb.SandboxID
			}
		})
	}
	wg.Wait()
	wall := time.Since(t0)
	if lat != nil {
		*lat = append(*lat, durs...)
	}
	kills := make(chan int, n)
	for i := range n {
		kills <- i
	}
	close(kills)
	for range l.clients {
		wg.Go(func() {
			for i := range kills {
				if ids[i] == "" {
					continue
				}
				if _, err := l.do(ctx, "DELETE", l.urls[(i+1)%len(l.urls)]+"/sandboxes/"+ids[i], nil, http.StatusNoContent); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return 0, fmt.Errorf("%d of %d requests failed, first: %w", len(errs), n, errs[0])
	}
	return float64(n) / wall.Seconds(), nil
}

// fleetRows renders the fleet figures: creates/s (target >= 100/s) per
// replica count beside one replica, and scheduling latency p50/p99.
func fleetRows(rs []FleetResult) []Row {
	var rows []Row
	var one float64
	for _, r := range rs {
		floor := Median(r.Floors)
		rows = append(rows, Row{fmt.Sprintf("fleet creates/s, %d workers, %d replica(s), %d clients, median of %d rounds", r.Workers, r.Replicas, r.Clients, len(r.Rates)),
			fmt.Sprintf("%.0f", r.Median()), fmt.Sprintf("%.0f store floor", floor), ratio(r.Median(), floor), ">= 100/s", atLeast(r.Median(), 100)})
		if r.Replicas == 1 {
			one = r.Median()
		} else if one > 0 {
			rows = append(rows, Row{fmt.Sprintf("fleet creates/s, %d replicas vs 1", r.Replicas), fmt.Sprintf("%.0f", r.Median()),
				fmt.Sprintf("%.0f with 1 replica", one), ratio(r.Median(), one), "", NotJudged})
		}
	}
	for _, r := range rs {
		s, l := ms(r.Schedule), ms(r.Latency)
		rows = append(rows,
			Row{fmt.Sprintf("fleet scheduling latency p50, %d replica(s), n=%d (ms)", r.Replicas, len(s)), fmt.Sprintf("%.2f", Median(s)),
				fmt.Sprintf("%.2f create end to end", Median(l)), ratio(Median(s), Median(l)), "", NotJudged},
			Row{fmt.Sprintf("fleet scheduling latency p99, %d replica(s), n=%d (ms)", r.Replicas, len(s)), fmt.Sprintf("%.2f", Percentile(s, 99)),
				fmt.Sprintf("%.2f create end to end", Percentile(l, 99)), ratio(Percentile(s, 99), Percentile(l, 99)), "", NotJudged})
	}
	return rows
}

// fleetNotes says how the fleet figures were measured.
func fleetNotes(rs []FleetResult) string {
	var b strings.Builder
	b.WriteString("fleet: internal/fleetsim workers (registered under leases, key bundle watched, every control call's capability verified by\n" +
		"  node-api's ControlHandler; no sandboxes) on embedded etcd, all in this process on the same cores as the control plane(s).\n" +
		"  Creates: POST /sandboxes (template base) with the API key, request i to replica i mod n; each round's sandboxes killed untimed,\n" +
		"  each through the next replica (with 2: not the one that created it).\n" +
		"  Scheduling latency: the control plane's arrival-to-placement time of each create (space_api_schedule_seconds' samples).\n" +
		"  Store floor (baseline, one round before each create round, same clients, same etcd): only the etcd operations a create waits\n" +
		"  for in turn (API key lookup, record create, record update); ratio = the share of that floor the whole create path keeps.\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "  %d replica(s): rounds %s creates/s (store floor %s); installs per worker %d..%d; control calls denied %d.\n"+
			"    phases (median ms): %s\n",
			r.Replicas, fmtRates(r.Rates), fmtRates(r.Floors), r.MinPerWorker, r.MaxPerWorker, r.Denied, formatPhases(r.Phases, append([]string{"api.schedule"}, createPhaseOrder...)))
	}
	return b.String()
}

func fmtRates(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(parts, ", ")
}

// runFleetOnly is Run for Config.Only == "fleet": no root, no binaries.
func runFleetOnly(ctx context.Context, cfg Config, out io.Writer, progress func(string, ...any), t0 time.Time) error {
	root, err := os.MkdirTemp("", "space-bench-fleet-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	rs, err := MeasureFleet(ctx, root, cfg.Fleet, cfg.Log, progress)
	progress("done in %s", time.Since(t0).Round(time.Second))
	fmt.Fprintln(out)
	if err != nil {
		return errors.Join(err, WriteTable(out, append(fleetRows(rs), Row{Figure: "fleet", Value: "error: " + errString(err)})))
	}
	if err := WriteTable(out, fleetRows(rs)); err != nil {
		return err
	}
	fmt.Fprintln(out)
	fmt.Fprint(out, fleetNotes(rs))
	return nil
}
