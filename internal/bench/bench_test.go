package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/substrate/ns"
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
	binDir := os.Getenv("SPACE_BIN_DIR")
	if os.Geteuid() != 0 || binDir == "" {
		b.Skip("needs root and SPACE_BIN_DIR (make build)")
	}
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
