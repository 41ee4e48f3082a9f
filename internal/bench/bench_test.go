package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/testenv"
)

func TestMain(m *testing.M) {
	ns.MaybeInit() // BenchmarkFileRead4KiB starts sandboxes from this binary
	os.Exit(m.Run())
}

func TestPercentile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	for _, c := range []struct{ p, want float64 }{{0, 1}, {50, 3}, {99, 5}, {100, 5}, {20, 1}, {21, 2}} {
		if got := Percentile(xs, c.p); got != c.want {
			t.Errorf("Percentile(%v) = %v, want %v", c.p, got, c.want)
		}
	}
	if xs[0] != 5 {
		t.Error("Percentile sorted its input")
	}
	if Median(nil) != 0 {
		t.Error("Median(nil) != 0")
	}
	var hundred []float64
	for i := 1; i <= 100; i++ {
		hundred = append(hundred, float64(i))
	}
	if p := Percentile(hundred, 99); p != 99 {
		t.Errorf("p99 of 1..100 = %v, want 99", p)
	}
}

// TestSignedMessage checks that the baseline verifies exactly the bytes a
// capability's signature covers.
func TestSignedMessage(t *testing.T) {
	f, err := NewCapFixture()
	if err != nil {
		t.Fatal(err)
	}
	toks, err := f.Issue(1)
	if err != nil {
		t.Fatal(err)
	}
	msg, sig, err := SignedMessage(toks[0])
	if err != nil {
		t.Fatal(err)
	}
	if !ed25519.Verify(f.pub, msg, sig) {
		t.Fatal("reconstructed PAE message does not verify")
	}
	msg[len(msg)-1] ^= 1
	if ed25519.Verify(f.pub, msg, sig) {
		t.Fatal("tampered message verifies")
	}
}

func TestMeasureCapabilitySmall(t *testing.T) {
	r, err := MeasureCapability(2, 5, 50)
	if err != nil {
		t.Fatal(err)
	}
	if r.ColdUS <= 0 || r.CachedUS <= 0 || r.RawEd25519US <= 0 {
		t.Fatalf("non-positive timings: %+v", r)
	}
}

// BenchmarkEd25519Verify is the baseline: a raw verify of a message the
// size of a capability's PASETO pre-authentication encoding.
func BenchmarkEd25519Verify(b *testing.B) {
	f, err := NewCapFixture()
	if err != nil {
		b.Fatal(err)
	}
	toks, _ := f.Issue(1)
	msg, sig, err := SignedMessage(toks[0])
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if !ed25519.Verify(f.pub, msg, sig) {
			b.Fatal("verify failed")
		}
	}
}

// BenchmarkCapabilityVerifyCold verifies distinct tokens (each a cache
// miss) through the exported API only.
func BenchmarkCapabilityVerifyCold(b *testing.B) {
	f, err := NewCapFixture()
	if err != nil {
		b.Fatal(err)
	}
	toks, err := f.Issue(4096)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if i == len(toks) {
			// Every token is cached now: a new verifier has an empty cache.
			b.StopTimer()
			f, _ = NewCapFixture()
			toks, _ = f.Issue(len(toks))
			i = 0
			b.StartTimer()
		}
		if _, err := f.Verifier.Verify(toks[i], capability.PurposeFiles); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkCapabilityVerifyCached re-verifies one token (cache hit).
func BenchmarkCapabilityVerifyCached(b *testing.B) {
	f, err := NewCapFixture()
	if err != nil {
		b.Fatal(err)
	}
	toks, _ := f.Issue(1)
	if _, err := f.Verifier.Verify(toks[0], capability.PurposeFiles); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := f.Verifier.Verify(toks[0], capability.PurposeFiles); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFileRead4KiB reads a 4 KiB file through the whole path of a
// platform with identity checks on (sub-benchmark "on") and off ("off").
// It needs root and the built binaries: SPACE_BIN_DIR=$PWD/bin go test
// -run '^$' -bench FileRead ./internal/bench
func BenchmarkFileRead4KiB(b *testing.B) {
	testenv.RequirePlatform(b)
	binDir := testenv.RequireBinDir(b)
	for _, side := range []struct {
		name string
		skip bool
	}{{"on", false}, {"off", true}} {
		b.Run(side.name, func(b *testing.B) {
			ctx := context.Background()
			p, err := StartPlatform(ctx, binDir, filepath.Join(b.TempDir(), "p"), 1, side.skip, discardLogger(os.Stderr))
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			s, err := prepareRead(ctx, p)
			if err != nil {
				b.Fatal(err)
			}
			defer s.sbx.Kill(ctx)
			var buf bytes.Buffer
			for range 20 {
				if _, err := s.read(ctx, &buf); err != nil {
					b.Fatal(err)
				}
			}
			var lat []time.Duration
			for b.Loop() {
				d, err := s.read(ctx, &buf)
				if err != nil {
					b.Fatal(err)
				}
				lat = append(lat, d)
			}
			l := ms(lat)
			b.ReportMetric(Median(l)*1000, "median-µs")
			b.ReportMetric(Percentile(l, 99)*1000, "p99-µs")
		})
	}
}

// BenchmarkCapabilityVerifyFloor is what a cold verify could cost at the
// least: base64-decode the token, Ed25519 over the PAE, one json decode of
// the claims. The gap to BenchmarkCapabilityVerifyCold is library overhead
// (go-paseto decodes the claims into a map, re-encodes them, and the
// footer is parsed twice).
func BenchmarkCapabilityVerifyFloor(b *testing.B) {
	f, err := NewCapFixture()
	if err != nil {
		b.Fatal(err)
	}
	toks, _ := f.Issue(1)
	b.ReportAllocs()
	for b.Loop() {
		msg, sig, err := SignedMessage(toks[0])
		if err != nil || !ed25519.Verify(f.pub, msg, sig) {
			b.Fatal("verify failed", err)
		}
		var c capability.Claims
		// The claims are the PAE's second piece: after the count, the
		// header's length and the header, and the claims' own length.
		body := msg[8+8+len("v4.public.")+8:]
		n := len(body) - 8 - len(footerOf(toks[0])) - 8 - len("space.capability.v1")
		if err := json.Unmarshal(body[:n], &c); err != nil || c.JTI == "" {
			b.Fatal("decode", err)
		}
	}
}

func footerOf(tok string) []byte {
	i := strings.LastIndexByte(tok, '.')
	f, _ := base64.RawURLEncoding.DecodeString(tok[i+1:])
	return f
}

func TestAccelLabel(t *testing.T) {
	for accel, want := range map[string]string{"tcg": " (TCG, no KVM)", "kvm": " (KVM)", "": "", "hvf": " (hvf)"} {
		if got := accelLabel(accel); got != want {
			t.Errorf("accelLabel(%q) = %q, want %q", accel, got, want)
		}
	}
}

func TestAlternate(t *testing.T) {
	xs := []int{1, 2}
	if got := alternate(xs, 0); got[0] != 1 || got[1] != 2 {
		t.Errorf("alternate even = %v", got)
	}
	if got := alternate(xs, 3); got[0] != 2 || got[1] != 1 {
		t.Errorf("alternate odd = %v", got)
	}
	if xs[0] != 1 {
		t.Error("alternate changed its input")
	}
}

func TestBootMore(t *testing.T) {
	for _, c := range []struct {
		i       int
		elapsed time.Duration
		budget  time.Duration
		want    bool
	}{
		{0, time.Hour, time.Second, true}, // the minimum is always taken
		{minBootSamples - 1, time.Hour, time.Second, true},
		{minBootSamples, time.Hour, time.Second, false},
		{minBootSamples, time.Millisecond, time.Second, true},
		{10, time.Hour, 0, true}, // no budget
	} {
		if got := bootMore(c.i, c.elapsed, c.budget); got != c.want {
			t.Errorf("bootMore(%d, %v, %v) = %v, want %v", c.i, c.elapsed, c.budget, got, c.want)
		}
	}
}

func TestVMRows(t *testing.T) {
	skipped := VMResult{Skipped: "no guest kernel in /x (make vm-deps)"}
	rows := skipped.Rows()
	if len(rows) != 1 || !strings.Contains(rows[0].Value, "skipped: no guest kernel") {
		t.Fatalf("skipped rows %+v", rows)
	}
	if !strings.Contains(skipped.Notes(), "skipped") {
		t.Errorf("skipped notes %q", skipped.Notes())
	}

	d := func(msx ...int) []time.Duration {
		var out []time.Duration
		for _, m := range msx {
			out = append(out, time.Duration(m)*time.Millisecond)
		}
		return out
	}
	r := VMResult{Accel: "tcg", Workers: 2,
		VM: SideResult{Template: vmTemplate, MemoryMB: 256, Create: d(900, 1000), Ready: d(1000, 3000, 2000), Pause: d(10), Resume: d(20),
			Snapshot: d(800), SnapshotBytes: []int64{100 << 20}, Migrate: d(6000, 7000, 5000), MigrateBytes: []int64{100 << 20}, PIDKept: 3},
		NS: SideResult{Template: nsTemplate, Create: d(90), Ready: d(100, 100), Pause: d(5), Resume: d(10),
			Snapshot: d(40), SnapshotBytes: []int64{1 << 20}, Migrate: d(600, 600, 600), MigrateBytes: []int64{1 << 20}, Restarted: 3},
	}
	rows = r.Rows()
	if len(rows) != 7 {
		t.Fatalf("%d rows: %+v", len(rows), rows)
	}
	for _, row := range rows {
		if !strings.HasPrefix(row.Figure, "microvm ") || !strings.HasSuffix(row.Figure, "(TCG, no KVM)") {
			t.Errorf("row %q is not labelled as a TCG microvm figure", row.Figure)
		}
		if row.Baseline == "" {
			t.Errorf("row %q has no ns baseline", row.Figure)
		}
	}
	boot := rows[0]
	if !strings.Contains(boot.Figure, "boot-to-ready (template clone) p50, n=3") || boot.Value != "2000.0" || boot.Baseline != "100.0 ns, n=2" || boot.Ratio != "20.00x" {
		t.Errorf("boot row %+v", boot)
	}
	size := rows[3]
	if !strings.Contains(size.Figure, "256 MiB VM") || size.Value != "100.0" || !strings.HasPrefix(size.Baseline, "1.00 ns") || size.Ratio != "100.00x" {
		t.Errorf("snapshot size row %+v", size)
	}
	if pid := rows[6]; pid.Value != "3/3" || pid.Baseline != "0/3 ns" {
		t.Errorf("pid row %+v", pid)
	}
	if n := r.Notes(); !strings.Contains(n, "not representative of KVM") || !strings.Contains(n, "processes_restarted on 0/3 microvm moves, 3/3 ns") {
		t.Errorf("notes %q", n)
	}
	// With cold boots beside the clones: one more row, judged against
	// 1/5 of the cold boot and 600 ms under TCG (150 ms under KVM).
	r.Cold = SideResult{Template: vmTemplate, Ready: d(11000, 9000, 10000)}
	rows = r.Rows()
	if len(rows) != 8 {
		t.Fatalf("%d rows with cold boots: %+v", len(rows), rows)
	}
	clone := rows[1]
	if !strings.Contains(clone.Figure, "template clone vs cold boot, n=3") || clone.Value != "2000.0" || clone.Baseline != "10000.0 cold, n=3" ||
		clone.Ratio != "0.20x" || clone.Verdict != Misses {
		t.Errorf("clone row %+v (2 s is 1/5 of the cold boot but over 600 ms)", clone)
	}
	r.VM.Ready = d(500, 400, 450)
	if v := r.Rows()[1].Verdict; v != Meets {
		t.Errorf("450 ms clone against 10 s cold under TCG: %v", v)
	}
	r.Accel = "kvm"
	if v := r.Rows()[1].Verdict; v != Misses {
		t.Errorf("450 ms clone under KVM (target 150 ms): %v", v)
	}
	if rows := r.Rows(); !strings.HasSuffix(rows[0].Figure, "(KVM)") || strings.Contains(r.Notes(), "TCG") {
		t.Errorf("kvm rows %q", rows[0].Figure)
	}
}

func TestIdleVMRows(t *testing.T) {
	r := IdleVMResult{Accel: "tcg", N: 3, MemoryMB: 256, Settle: time.Second,
		PSS: []float64{50 << 20, 60 << 20, 70 << 20}, QEMUPSS: []float64{46 << 20}, HostPSS: []float64{4 << 20},
		ShmemPSS: []float64{1 << 20}, SharedRSS: []float64{20 << 20}, RSS: []float64{90 << 20}}
	rows := r.Rows()
	if len(rows) != 1 || rows[0].Value != "60.0" || rows[0].Verdict != Meets || !strings.HasSuffix(rows[0].Figure, "(TCG, no KVM)") {
		t.Fatalf("rows %+v", rows)
	}
	r.PSS = []float64{65 << 20}
	if v := r.Rows()[0].Verdict; v != Misses {
		t.Errorf("65 MiB per idle VM: %v", v)
	}
	if n := r.Notes(); !strings.Contains(n, "QEMU PSS 46.0 (of which the template's shared pages 1.0") {
		t.Errorf("notes %q", n)
	}
}

func TestVMUnavailable(t *testing.T) {
	// A bin dir with no .cache beside it: QEMU or the kernel is missing.
	why := vmUnavailable(filepath.Join(t.TempDir(), "bin"))
	if !strings.Contains(why, "make vm-deps") {
		t.Errorf("vmUnavailable = %q", why)
	}
}

func TestIsolationRows(t *testing.T) {
	var r IsolationResult
	for m, d := range map[int]time.Duration{IsoAll: 10 * time.Millisecond, IsoNoUser: 9 * time.Millisecond, IsoNone: 5 * time.Millisecond} {
		r.Start[m] = []time.Duration{d, d, d}
		r.MemPSS[m] = []int64{3 << 20}
		r.MemCg[m] = []int64{1 << 20}
	}
	rows := r.rows()
	if len(rows) != 4 || rows[0].Verdict != Misses || rows[2].Verdict != Meets || rows[1].Verdict != NotJudged {
		t.Fatalf("10 vs 9 ms must miss 1.10x, equal memory must meet: %+v", rows)
	}
	r.Start[IsoAll] = []time.Duration{9900 * time.Microsecond}
	if rows := r.rows(); rows[0].Verdict != Meets || rows[0].Ratio != "1.10x" {
		t.Fatalf("9.9 vs 9 ms: %+v", rows[0])
	}
	// With the platforms' figures: create 30 vs 25 ms misses, memory meets.
	r.Create = [2][]time.Duration{{30 * time.Millisecond}, {25 * time.Millisecond}}
	r.PSS = [2][]int64{{5 << 20}, {5 << 20}}
	if rows := r.rows(); len(rows) != 6 || rows[0].Verdict != Misses || rows[1].Verdict != Meets {
		t.Fatalf("platform rows: %+v", rows)
	}
}

// The re-adoption figure measures a real restart: every sandbox serves
// its file again, and the time is the restarted process's.
func TestMeasureReadopt(t *testing.T) {
	testenv.RequirePlatform(t)
	binDir := testenv.RequireBinDir(t)
	root, err := os.MkdirTemp("", "readopt-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	res, err := MeasureReadopt(context.Background(), binDir, root, 3)
	if err != nil {
		t.Fatal(err)
	}
	if res.N != 3 || len(res.Create) != 3 || len(res.Serving) != readoptRounds || len(res.Ready) != readoptRounds || res.ReadyEmpty <= 0 {
		t.Fatalf("result %+v", res)
	}
	for i := range res.Serving {
		if res.Serving[i] < res.Ready[i] || res.Ready[i] <= 0 {
			t.Fatalf("restart %d: ready %v, serving %v", i+1, res.Ready[i], res.Serving[i])
		}
	}
	if res.SameGeneration != 3 {
		t.Fatalf("%d of 3 sandboxes kept their execution across the restarts, want all (re-adopted)", res.SameGeneration)
	}
	t.Logf("%+v", res.Rows())
}

// BenchmarkFleetCreate is the control plane's create rate against 100
// simulated workers (fleet.go), with 1 and 2 replicas: each op is one
// sandbox created through the REST API by one of 16 parallel clients
// (killed, untimed, after the loop). No root, no binaries:
// go test -run '^$' -bench FleetCreate ./internal/bench
func BenchmarkFleetCreate(b *testing.B) {
	for _, replicas := range []int{1, 2} {
		b.Run(fmt.Sprintf("replicas=%d", replicas), func(b *testing.B) {
			ctx := context.Background()
			e, err := StartFleet(ctx, b.TempDir(), 100, replicas, 16, io.Discard)
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			if _, err := e.Round(ctx, 16, nil); err != nil { // warm-up
				b.Fatal(err)
			}
			b.ResetTimer()
			rate, err := e.Round(ctx, b.N, nil) // ns/op counts the kills too; creates/s does not
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(rate, "creates/s")
		})
	}
}

// TestFleetSmall runs the fleet section small: both replica counts,
// every create placed and verified, rows rendered.
func TestFleetSmall(t *testing.T) {
	rs, err := MeasureFleet(context.Background(), t.TempDir(), FleetConfig{Workers: 10, Clients: 4, Rounds: 2, Creates: 12, Replicas: []int{1, 2}},
		io.Discard, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[1].Replicas != 2 || len(rs[0].Rates) != 2 || len(rs[0].Schedule) != 24 || rs[0].Denied != 0 {
		t.Fatalf("results: %+v", rs)
	}
	rows := fleetRows(rs)
	if len(rows) != 7 || rows[0].Target != ">= 100/s" || !strings.Contains(rows[0].Baseline, "store floor") ||
		!strings.Contains(rows[2].Baseline, "with 1 replica") || len(rs[0].Floors) != 2 {
		t.Fatalf("rows: %+v", rows)
	}
}
