package controlplane

import (
	"errors"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// The decoders never panic and always classify their failures.
func FuzzDecodeCreate(f *testing.F) {
	for _, s := range []string{`{"templateID":"base"}`, `{"timeout":1e99}`, `{`, `null`, `{"metadata":{"a":1}}`, `"x"`, `{"envVars":[]}`} {
		f.Add(s)
	}
	srv := &Server{cfg: Config{DataDir: "x"}.withDefaults()}
	f.Fuzz(func(t *testing.T, s string) {
		var req e2bapi.NewSandbox
		if err := decodeReader(strings.NewReader(s), &req, false); err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("unclassified decode error %v", err)
			}
			return
		}
		if _, err := srv.validateCreate(caller{TeamID: "t"}, req, true); err != nil && !errors.Is(err, errdefs.ErrInvalid) && !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("unclassified validation error %v", err)
		}
		var cr spacev1.CapabilityRequest
		if err := decodeReader(strings.NewReader(s), &cr, true); err == nil {
			_ = validatePurpose(cr)
		}
		_, _ = parseSandboxID(s)
		_, _ = parseMetadataQuery(s)
		_, _ = decodeCursor(s)
	})
}
