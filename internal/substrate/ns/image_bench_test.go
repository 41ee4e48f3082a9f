//go:build linux

package ns

import (
	"context"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// BenchmarkStartImageVsHost: raw Start of the Debian base image against
// the host template, interleaved.
func BenchmarkStartImageVsHost(b *testing.B) {
	s := needRoot(b)
	bi, err := baseimage.Lookup(baseimage.Config{})
	if err != nil {
		testenv.Skipf(b, "the Debian base image is not built: %v", err)
	}
	img := &substrate.Image{ID: bi.ID, Layers: []string{bi.Dir}, Env: bi.Env}
	ctx := context.Background()
	var ti, th time.Duration
	for i := 0; i < b.N; i++ {
		for _, useImg := range []bool{true, false} {
			spec := newSpec(b, substrate.Limits{})
			spec.AgentEnv = []string{`SPACE_GUEST_CONFIG={"identity":{}}`}
			if useImg {
				spec.Image = img
			}
			t0 := time.Now()
			in, err := s.Start(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			if useImg {
				ti += d
			} else {
				th += d
			}
			_ = in.Stop(ctx)
		}
	}
	b.ReportMetric(float64(ti.Microseconds())/1000/float64(b.N), "image-ms/op")
	b.ReportMetric(float64(th.Microseconds())/1000/float64(b.N), "host-ms/op")
}
