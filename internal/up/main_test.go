package up

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/testenv"
)

// Limits every sandbox of the test platform gets: small enough that the
// memory hog and the fork bomb hit them quickly, large enough for a login
// shell and the guest agent.
const (
	testMemoryLimit = 128 << 20
	testPidsLimit   = 128
)

var (
	// plat is the platform every test drives, started once by TestMain.
	plat *Platform
	// testTransport carries every HTTP request of the tests, so idle
	// connections can be closed before the leak check.
	testTransport = http.DefaultTransport.(*http.Transport).Clone()
)

func TestMain(m *testing.M) {
	ns.MaybeInit() // this test binary is also the sandbox init
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	if !testenv.RequireMainRoot("internal/up", "the platform suite: namespaces, cgroups, mounts, embedded etcd") {
		return 0
	}
	tmp, err := os.MkdirTemp("", "space-up-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)

	bin, cleanup, err := testenv.BinDir() // $SPACE_BIN_DIR (make test) or a fresh build
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cleanup()
	logPath := filepath.Join(tmp, "platform.log")
	logf, err := os.Create(logPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer logf.Close()
	log := slog.New(slog.NewTextHandler(logf, &slog.HandlerOptions{Level: slog.LevelInfo}))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	p, err := Start(ctx, Config{
		APIAddr:       "127.0.0.1:0",
		EdgeAddr:      "127.0.0.1:0",
		DataDir:       filepath.Join(tmp, "data"),
		Workers:       2,
		BinDir:        bin,
		DefaultLimits: spacev1.Limits{MemoryBytes: testMemoryLimit, Pids: testPidsLimit},
		Logger:        log,
	})
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "up.Start: %v\n", err)
		dumpLog(logPath)
		return 1
	}
	plat = p

	code := m.Run()

	if err := p.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "platform component stopped on its own: %v\n", err)
		code = 1
	}
	p.Close()
	testTransport.CloseIdleConnections()
	if code != 0 {
		dumpLog(logPath)
		return code
	}
	if err := goleak.Find(); err != nil {
		fmt.Fprintln(os.Stderr, "goleak:", err)
		return 1
	}
	return 0
}

// dumpLog prints the tail of the platform log (on failure only).
func dumpLog(path string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > 150 {
		lines = lines[len(lines)-150:]
	}
	fmt.Fprintf(os.Stderr, "--- platform log (last %d lines) ---\n%s\n", len(lines), strings.Join(lines, "\n"))
}
