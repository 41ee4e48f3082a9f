package bench

// Re-adoption after a worker restart: `space up` (workers in its process)
// is started from the binaries, holds N live sandboxes, is killed with
// SIGKILL and started again on the same data; the figure is the time from
// that start until every sandbox serves a file again, beside a plain
// create of the same run.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/sdk"
)

// ReadoptResult is one restart with N live sandboxes.
type ReadoptResult struct {
	N int
	// Serving is, per restart, from the new process's start until the
	// last of the N sandboxes answered a file read with its content; Ready
	// until space up printed its banner.
	Serving, Ready []time.Duration
	// ReadyEmpty is the first start of the same run, with no sandbox
	// (the baseline of Ready).
	ReadyEmpty time.Duration
	// SameGeneration counts the sandboxes that answered as the execution
	// they ran before the kill (re-adopted); the others came back as new
	// executions (recovered).
	SameGeneration int
	// Create are the N creates before the kill.
	Create []time.Duration
}

// live is a sandbox held across the restarts, with the execution it ran
// before the first.
type live struct {
	s   *sdk.Sandbox
	gen string
}

// readoptPlatform is a `space up` process started from binDir.
type readoptPlatform struct {
	cmd    *exec.Cmd
	client *sdk.Client
	api    string
}

// startUp starts `space up` on dataDir and returns once its banner is out.
func startUp(ctx context.Context, binDir, dataDir string, workers int) (*readoptPlatform, error) {
	api, err := freeAddr()
	if err != nil {
		return nil, err
	}
	edge, err := freeAddr()
	if err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(filepath.Join(filepath.Dir(dataDir), "space-up.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(binDir, "space"), "up", "--api-addr", api, "--edge-addr", edge, "--data-dir", dataDir,
		"--api-key", benchAPIKey, "--workers", strconv.Itoa(workers), "--log-level", "error",
		"--keep-sandboxes=false", "--edge-tls-addr=") // a crash (kill) leaves them running; a stop ends them
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start space up: %w", err)
	}
	ready := make(chan bool, 1)
	go func() { // owned: ends when space up closes its stdout
		sc := bufio.NewScanner(out)
		sent := false
		for sc.Scan() {
			if !sent && strings.HasPrefix(sc.Text(), "export E2B_API_KEY=") {
				ready <- true
				sent = true
			}
		}
		if !sent {
			close(ready)
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			cmd.Wait()
			return nil, fmt.Errorf("space up exited before it was ready (log %s)", logf.Name())
		}
	case <-time.After(2 * time.Minute):
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("space up not ready after 2m")
	case <-ctx.Done():
		cmd.Process.Kill()
		cmd.Wait()
		return nil, ctx.Err()
	}
	c, err := sdk.New(sdk.Config{APIURL: "http://" + api, SandboxURL: "http://" + edge, APIKey: benchAPIKey})
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	return &readoptPlatform{cmd: cmd, client: c, api: "http://" + api}, nil
}

// kill ends the process with SIGKILL (a crash) and waits for it.
func (p *readoptPlatform) kill() {
	p.cmd.Process.Kill()
	p.cmd.Wait()
}

// stop interrupts the process and waits for it.
func (p *readoptPlatform) stop() {
	p.cmd.Process.Signal(syscall.SIGINT)
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		p.kill()
	}
}

// MeasureReadopt creates n sandboxes (8 at a time, timed) with a file
// each on a one-worker `space up`, kills it, starts it again and times
// until all n serve their file.
func MeasureReadopt(ctx context.Context, binDir, root string, n int) (ReadoptResult, error) {
	res := ReadoptResult{N: n}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return res, err
	}
	dataDir := filepath.Join(root, "data")
	t1 := time.Now()
	p1, err := startUp(ctx, binDir, dataDir, 1)
	if err != nil {
		return res, err
	}
	res.ReadyEmpty = time.Since(t1)
	sbxs := make([]live, n)
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
		sem  = make(chan struct{}, 8)
	)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			t0 := time.Now()
			s, err := p1.client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 30 * time.Minute})
			d := time.Since(t0)
			if err == nil {
				_, err = s.WriteFile(ctx, "/home/user/kept", []byte("kept "+s.ID))
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			res.Create = append(res.Create, d)
			sbxs[i] = live{s: s}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		p1.kill()
		return res, fmt.Errorf("%d of %d creates failed: %w", len(errs), n, errs[0])
	}
	for i := range sbxs {
		if sbxs[i].gen, err = executionOf(ctx, p1.api, sbxs[i].s.ID); err != nil {
			p1.kill()
			return res, err
		}
	}
	p1.kill()

	for round := range readoptRounds {
		ready, serving, same, err := restartAndServe(ctx, binDir, dataDir, sbxs, round == readoptRounds-1)
		if err != nil {
			return res, fmt.Errorf("restart %d: %w", round+1, err)
		}
		res.Ready, res.Serving = append(res.Ready, ready), append(res.Serving, serving)
		res.SameGeneration = same
	}
	return res, nil
}

// readoptRounds is how many times the worker is killed and restarted
// under the same live sandboxes (each figure is the median).
const readoptRounds = 3

// restartAndServe starts space up on dataDir and times until it is ready
// and until every one of sbxs serves its file again; it then kills it (a
// crash: the sandboxes live on for the next round), or stops it with the
// sandboxes when last. same counts the sandboxes still on the execution
// they ran at the first kill.
func restartAndServe(ctx context.Context, binDir, dataDir string, sbxs []live, last bool) (ready, serving time.Duration, same int, err error) {
	t0 := time.Now()
	p, err := startUp(ctx, binDir, dataDir, 1)
	if err != nil {
		return 0, 0, 0, err
	}
	if last {
		defer p.stop()
	} else {
		defer p.kill()
	}
	ready = time.Since(t0)
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
		sem  = make(chan struct{}, 8)
	)
	deadline := t0.Add(10 * time.Minute)
	for i := range sbxs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			s := p.client.Attach(sbxs[i].s.ID, sbxs[i].s.AccessToken)
			for {
				if b, err := s.ReadFile(ctx, "/home/user/kept"); err == nil && string(b) == "kept "+s.ID {
					break
				}
				if time.Now().After(deadline) || ctx.Err() != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("sandbox %s does not serve after the restart", s.ID))
					mu.Unlock()
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
			if gen, err := executionOf(ctx, p.api, s.ID); err == nil && gen == sbxs[i].gen {
				mu.Lock()
				same++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	serving = time.Since(t0)
	if len(errs) > 0 {
		return ready, serving, same, fmt.Errorf("%d of %d sandboxes: %w", len(errs), len(sbxs), errs[0])
	}
	return ready, serving, same, nil
}

// executionOf returns the execution the control plane names for sandbox
// id (its generation and execution id).
func executionOf(ctx context.Context, api, id string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, api+"/space/v1/sandboxes/"+id+"/executions", nil)
	if err != nil {
		return "", err
	}
	req.Header.Set(spacev1.HeaderAPIKey, benchAPIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer res.Body.Close()
	var execs []spacev1.Execution
	if err := json.NewDecoder(res.Body).Decode(&execs); err != nil {
		return "", fmt.Errorf("executions of %s: %w", id, err)
	}
	for _, e := range execs {
		if e.State == "running" {
			return e.Route.ExecutionLabel(), nil
		}
	}
	return "", fmt.Errorf("sandbox %s has no running execution", id)
}

// Rows renders the figures (medians over the restarts) beside the
// creates and the first start of the same run.
func (r ReadoptResult) Rows() []Row {
	cr, sv, rd := ms(r.Create), ms(r.Serving), ms(r.Ready)
	empty := float64(r.ReadyEmpty) / float64(time.Millisecond)
	return []Row{
		{fmt.Sprintf("worker start to serving again, %d live sandboxes, p50 of %d restarts (re-adoption; %d kept their execution) (ms)", r.N, len(sv), r.SameGeneration),
			fmt.Sprintf("%.0f", Median(sv)), fmt.Sprintf("%.1f create p50", Median(cr)), ratio(Median(sv), Median(cr)), "", NotJudged},
		{fmt.Sprintf("worker start to ready (banner) with %d live sandboxes to adopt, p50 (ms)", r.N), fmt.Sprintf("%.0f", Median(rd)),
			fmt.Sprintf("%.0f first start, none", empty), ratio(Median(rd), empty), "", NotJudged},
	}
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
