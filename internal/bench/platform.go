package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"time"

	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/up"
	"github.com/spacesbx/space/sdk"
)

// benchAPIKey is the bootstrap key of the benchmark platforms.
const benchAPIKey = "e2b_bec4bec4bec4bec4bec4bec4bec4bec4bec4bec4"

// Platform is a started single-machine SPACE and a client for it.
type Platform struct {
	*up.Platform
	Client *sdk.Client
	// DataDir is the platform's state; snapshots are objects in
	// DataDir/snapshots (up's default SnapshotDir).
	DataDir string
}

// StartPlatform starts SPACE on free ports with its state under dataDir.
func StartPlatform(ctx context.Context, binDir, dataDir string, workers int, skipIdentity bool, log *slog.Logger) (*Platform, error) {
	return StartPlatformConfig(ctx, up.Config{
		DataDir: dataDir, Workers: workers, BinDir: binDir, UnsafeSkipIdentityChecks: skipIdentity, Logger: log,
	})
}

// StartPlatformConfig starts SPACE as cfg says, on free ports and with the
// benchmark's API key.
func StartPlatformConfig(ctx context.Context, cfg up.Config) (*Platform, error) {
	cfg.APIAddr, cfg.EdgeAddr, cfg.APIKey = "127.0.0.1:0", "127.0.0.1:0", benchAPIKey
	dataDir := cfg.DataDir
	p, err := up.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	// A transport of its own: keep-alive connections to this platform only.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 8
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey, HTTPClient: &http.Client{Transport: tr}})
	if err != nil {
		p.Close()
		return nil, err
	}
	return &Platform{Platform: p, Client: c, DataDir: dataDir}, nil
}

// BridgePID finds the spaced-host and agent pids of sandbox on any worker.
func (p *Platform) BridgePID(sandbox string) (host, guest int, ok bool) {
	for _, w := range p.Workers {
		if h, g, ok := w.Manager().BridgePID(sandbox); ok {
			return h, g, true
		}
	}
	return 0, 0, false
}

// ReadResult is the 4 KiB read latency with identity checks on and off.
type ReadResult struct {
	On, Off []time.Duration
	// RoundRatios is median(on)/median(off) within each round: adjacent in
	// time, so slow drift of the machine cancels out.
	RoundRatios []float64
}

// readSide is one platform's sandbox with a 4 KiB file in it.
type readSide struct {
	sbx  *sdk.Sandbox
	path string
	want []byte
}

func prepareRead(ctx context.Context, p *Platform) (*readSide, error) {
	sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute})
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	data := make([]byte, 4096)
	_, _ = rand.Read(data)
	const path = "/home/user/bench-4k.bin"
	if _, err := sbx.WriteFile(ctx, path, data); err != nil {
		return nil, fmt.Errorf("write: %w", err)
	}
	return &readSide{sbx: sbx, path: path, want: data}, nil
}

func (s *readSide) read(ctx context.Context, buf *bytes.Buffer) (time.Duration, error) {
	buf.Reset()
	t0 := time.Now()
	n, err := s.sbx.ReadFileTo(ctx, s.path, buf)
	d := time.Since(t0)
	if err != nil {
		return 0, err
	}
	if n != int64(len(s.want)) || !bytes.Equal(buf.Bytes(), s.want) {
		return 0, fmt.Errorf("read %d bytes, content differs from what was written", n)
	}
	return d, nil
}

// MeasureRead reads the same 4 KiB file through edge -> node-api ->
// sbx-manager -> spaced-host -> guest on both platforms: warmup reads per
// side, then rounds of perRound read pairs, one read per side in each
// pair, alternating which side goes first, so drift hits both alike.
func MeasureRead(ctx context.Context, on, off *Platform, warmup, rounds, perRound int) (ReadResult, error) {
	var res ReadResult
	sOn, err := prepareRead(ctx, on)
	if err != nil {
		return res, fmt.Errorf("identity checks on: %w", err)
	}
	defer sOn.sbx.Kill(context.WithoutCancel(ctx))
	sOff, err := prepareRead(ctx, off)
	if err != nil {
		return res, fmt.Errorf("identity checks off: %w", err)
	}
	defer sOff.sbx.Kill(context.WithoutCancel(ctx))
	var buf bytes.Buffer
	for range warmup {
		for _, s := range []*readSide{sOn, sOff} {
			if _, err := s.read(ctx, &buf); err != nil {
				return res, fmt.Errorf("warm-up read: %w", err)
			}
		}
	}
	for r := range rounds {
		var roundOn, roundOff []time.Duration
		for i := range perRound {
			// Pairs alternate which side goes first (on,off / off,on) so
			// neither side always follows the other.
			order := [2]bool{true, false}
			if (r+i)%2 == 1 {
				order = [2]bool{false, true}
			}
			for _, isOn := range order {
				s, dst := sOn, &roundOn
				if !isOn {
					s, dst = sOff, &roundOff
				}
				d, err := s.read(ctx, &buf)
				if err != nil {
					return res, fmt.Errorf("read (identity checks on=%v): %w", isOn, err)
				}
				*dst = append(*dst, d)
			}
		}
		res.On = append(res.On, roundOn...)
		res.Off = append(res.Off, roundOff...)
		res.RoundRatios = append(res.RoundRatios, Median(ms(roundOn))/Median(ms(roundOff)))
	}
	return res, nil
}

// discardLogger drops everything below Error.
func discardLogger(w io.Writer) *slog.Logger {
	log, _ := logsetup.New(w, logsetup.Options{Level: "error"}) // valid options: no error
	return log
}

func platformDir(root, name string) string { return filepath.Join(root, name) }
