// Package store keeps SPACE's control-plane state in etcd: worker
// registrations (under leases), the verification key bundle, sandbox records
// (changed only through revision-guarded transactions) and API keys (by hash).
//
// It is the only package that imports etcd. By default it runs an embedded
// single-node etcd under Config.DataDir; with Config.Endpoints it uses an
// external cluster instead.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"google.golang.org/grpc"

	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/errdefs"
)

// Errors the store returns wrap the errdefs classes (test with errors.Is):
// errdefs.ErrNotFound when a key does not exist, errdefs.ErrConflict when it
// already exists or its revision moved since the caller read it (a lost
// compare-and-swap), errdefs.ErrInvalid for a value the store refuses to
// write, and ErrClosed once the store is closed.

// ErrClosed: the store was closed. It is an errdefs.ErrUnavailable.
var ErrClosed = errdefs.Message(errdefs.ErrUnavailable, "store closed")

// Key layout.
const (
	prefix              = "/space/"
	workersPrefix       = prefix + "workers/"
	sandboxesPrefix     = prefix + "sandboxes/"
	apiKeysPrefix       = prefix + "apikeys/"
	bundleKey           = prefix + "bundle"
	controlPlanesPrefix = prefix + "controlplanes/"
)

// Defaults.
const (
	DefaultDialTimeout  = 5 * time.Second
	DefaultStartTimeout = 60 * time.Second
	DefaultCloseTimeout = 10 * time.Second
	// DefaultCompactionRetention is the embedded etcd's periodic
	// compaction window: history older than this is compacted away.
	DefaultCompactionRetention = "1h"
)

// Config configures Open.
type Config struct {
	// DataDir holds the embedded etcd's data (DataDir/etcd) and the chosen
	// listen URLs (DataDir/etcd-urls.json, reused on restart). Required
	// unless Endpoints is set.
	DataDir string
	// Endpoints of an external etcd cluster. When set, no etcd is embedded
	// and DataDir, ClientURL and PeerURL are ignored.
	Endpoints []string
	// ClientURL and PeerURL are the embedded etcd's listen URLs. Default:
	// http://127.0.0.1:<free port> each, remembered in DataDir so a restart
	// reuses them when still free.
	ClientURL string
	PeerURL   string
	// DialTimeout bounds connecting to etcd (default 5 s).
	DialTimeout time.Duration
	// StartTimeout bounds the embedded etcd's start (default 60 s).
	StartTimeout time.Duration
	// CloseTimeout bounds Close (default 10 s).
	CloseTimeout time.Duration
	// Logger receives the store's own logs (default slog.Default()). etcd's
	// zap logging is kept at warn level on stderr.
	Logger *slog.Logger
}

// withDefaults returns c with every unset (zero or negative) timeout and a
// nil Logger replaced by its documented default.
func (c Config) withDefaults() Config {
	if c.DialTimeout <= 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.StartTimeout <= 0 {
		c.StartTimeout = DefaultStartTimeout
	}
	if c.CloseTimeout <= 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports whether c can be opened. It only checks: unset fields
// that have a default are valid (Open fills the defaults first).
func (c Config) Validate() error {
	if len(c.Endpoints) == 0 && c.DataDir == "" {
		return fmt.Errorf("store config: %w: data dir or etcd endpoints required", errdefs.ErrInvalid)
	}
	for _, e := range c.Endpoints {
		if e == "" {
			return fmt.Errorf("store config: %w: empty etcd endpoint", errdefs.ErrInvalid)
		}
	}
	for name, u := range map[string]string{"client url": c.ClientURL, "peer url": c.PeerURL} {
		if u == "" {
			continue
		}
		pu, err := url.Parse(u)
		if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			return fmt.Errorf("store config: %w: %s %q must be http(s)://host:port", errdefs.ErrInvalid, name, u)
		}
	}
	return nil
}

// Store is a handle on SPACE's etcd state. It is safe for concurrent use.
type Store struct {
	cli       *clientv3.Client
	etcd      *embed.Etcd
	log       *slog.Logger
	closing   atomic.Bool // Close began: etcd's listener-closed errors are expected
	endpoints []string
	closeTO   time.Duration
	closeOnce sync.Once
	closeErr  error
	latency   *prometheus.HistogramVec // etcd request latency (metrics.go)
}

// Open connects to etcd, starting the embedded one unless cfg.Endpoints is
// set. ctx bounds the start.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Store{log: cfg.Logger.With("component", "store"), closeTO: cfg.CloseTimeout, latency: newOpLatency()}
	endpoints := cfg.Endpoints
	if len(endpoints) == 0 {
		e, client, err := startEmbedded(ctx, cfg, &s.closing)
		if err != nil {
			return nil, err
		}
		s.etcd = e
		endpoints = []string{client}
	}
	zl := newEtcdLogger(cfg.Logger, &s.closing)
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: cfg.DialTimeout,
		Logger:      zl,
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(latencyInterceptor(s.latency))},
	})
	if err != nil {
		s.stopEmbedded()
		return nil, fmt.Errorf("store: connect etcd: %w", err)
	}
	s.cli = cli
	s.endpoints = endpoints
	// A first read proves the cluster answers.
	pctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	defer cancel()
	if _, err := cli.Get(pctx, bundleKey, clientv3.WithCountOnly()); err != nil {
		_ = cli.Close()
		s.stopEmbedded()
		return nil, fmt.Errorf("store: etcd at %v not answering: %w", endpoints, err)
	}
	s.log.Info("store open", "endpoints", endpoints, "embedded", s.etcd != nil)
	return s, nil
}

// Endpoints are the etcd client URLs in use (the embedded one's when
// embedded), e.g. to hand to another process on the same machine.
func (s *Store) Endpoints() []string { return append([]string(nil), s.endpoints...) }

// Ping checks that etcd answers within ctx.
func (s *Store) Ping(ctx context.Context) error {
	if _, err := s.cli.Get(ctx, bundleKey, clientv3.WithCountOnly()); err != nil {
		return fmt.Errorf("store: ping: %w", err)
	}
	return nil
}

// Close closes the client and stops the embedded etcd, bounded by
// Config.CloseTimeout. Registrations should be closed first.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.closing.Store(true)
		if s.cli != nil {
			_ = s.cli.Close()
		}
		s.closeErr = s.stopEmbedded()
	})
	return s.closeErr
}

func (s *Store) stopEmbedded() error {
	if s.etcd == nil {
		return nil
	}
	done := make(chan struct{})
	go func() {
		s.etcd.Close()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-time.After(s.closeTO):
		return fmt.Errorf("store: embedded etcd did not stop within %s", s.closeTO)
	}
}

type savedURLs struct {
	Client string `json:"client"`
	Peer   string `json:"peer"`
}

func startEmbedded(ctx context.Context, cfg Config, closing *atomic.Bool) (*embed.Etcd, string, error) {
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, "", fmt.Errorf("store: data dir: %w", err)
	}
	urlsFile := filepath.Join(cfg.DataDir, "etcd-urls.json")
	var saved savedURLs
	if b, err := os.ReadFile(urlsFile); err == nil {
		_ = json.Unmarshal(b, &saved)
	}
	for attempt := 1; ; attempt++ {
		e, url, err := startEmbeddedOnce(ctx, cfg, closing, urlsFile, saved)
		// A port found free a moment ago can be taken before etcd binds
		// it (parallel test processes do): choose again, unless the
		// operator named the URLs.
		if err != nil && attempt < 4 && cfg.ClientURL == "" && cfg.PeerURL == "" &&
			(errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")) {
			cfg.Logger.Warn("embedded etcd: port taken before it was bound; choosing another", "attempt", attempt, "err", err)
			saved = savedURLs{}
			continue
		}
		return e, url, err
	}
}

func startEmbeddedOnce(ctx context.Context, cfg Config, closing *atomic.Bool, urlsFile string, saved savedURLs) (*embed.Etcd, string, error) {
	clientURL, err := chooseURL(cfg.ClientURL, saved.Client)
	if err != nil {
		return nil, "", err
	}
	peerURL, err := chooseURL(cfg.PeerURL, saved.Peer)
	if err != nil {
		return nil, "", err
	}
	if b, err := json.Marshal(savedURLs{Client: clientURL, Peer: peerURL}); err == nil {
		_ = atomicfile.Write(urlsFile, b, 0o600)
	}
	cu, _ := url.Parse(clientURL)
	pu, _ := url.Parse(peerURL)

	ec := embed.NewConfig()
	ec.Name = "space"
	ec.Dir = filepath.Join(cfg.DataDir, "etcd")
	ec.ListenClientUrls = []url.URL{*cu}
	ec.AdvertiseClientUrls = []url.URL{*cu}
	ec.ListenPeerUrls = []url.URL{*pu}
	ec.AdvertisePeerUrls = []url.URL{*pu}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	ec.LogLevel = "warn"
	ec.Logger = "zap"
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(newEtcdLogger(cfg.Logger, closing))
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = DefaultCompactionRetention

	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, "", fmt.Errorf("store: start embedded etcd: %w", err)
	}
	t := time.NewTimer(cfg.StartTimeout)
	defer t.Stop()
	select {
	case <-e.Server.ReadyNotify():
		return e, clientURL, nil
	case err := <-e.Err():
		e.Close()
		return nil, "", fmt.Errorf("store: embedded etcd failed: %w", err)
	case <-ctx.Done():
		e.Close()
		return nil, "", fmt.Errorf("store: embedded etcd start: %w", ctx.Err())
	case <-t.C:
		e.Close()
		return nil, "", fmt.Errorf("store: embedded etcd not ready within %s", cfg.StartTimeout)
	}
}

// chooseURL returns configured, else saved when its port is still free, else
// a loopback URL on a free port.
func chooseURL(configured, saved string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	if saved != "" {
		if u, err := url.Parse(saved); err == nil && portFree(u.Host) {
			return saved, nil
		}
	}
	p, err := freePort()
	if err != nil {
		return "", err
	}
	return "http://127.0.0.1:" + strconv.Itoa(p), nil
}

func portFree(hostport string) bool {
	l, err := net.Listen("tcp", hostport)
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// freePort is FreePort; tests make it hand out a taken port.
var freePort = FreePort

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("store: find free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// wrapErr maps a client error: a closed client reads as ErrClosed.
func wrapErr(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("store: %s: %w", op, err)
	}
	if errors.Is(err, clientv3.ErrNoAvailableEndpoints) {
		return fmt.Errorf("store: %s: %w", op, ErrClosed) // the client's own text says no more, and must not reach API clients
	}
	return fmt.Errorf("store: %s: %w", op, err)
}
