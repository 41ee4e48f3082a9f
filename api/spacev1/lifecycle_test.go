package spacev1

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/identity"
)

// The lifecycle wire types keep the JSON names clients already read.
func TestLifecycleWireNames(t *testing.T) {
	r := identity.Route{SandboxID: "s1", Generation: 2, WorkerID: "w2"}
	for _, c := range []struct {
		v    any
		want []string
	}{
		{MigrateRequest{TargetWorker: "w2"}, []string{`"target_worker":"w2"`}},
		{MigrateResponse{SandboxID: "s1", Route: r, SnapshotID: "snap-1", FilesKept: true, Note: "n"}, []string{
			`"sandbox_id":"s1"`, `"from":`, `"route":`, `"execution":`, `"snapshot_id":"snap-1"`,
			`"processes_restarted":false`, `"files_kept":true`, `"note":"n"`,
		}},
		{RotateResponse{KeyID: "k2", PreviousKeyID: "k1", PreviousNotAfter: time.Unix(0, 0).UTC(), BundleRevision: 3}, []string{
			`"kid":"k2"`, `"previous_kid":"k1"`, `"previous_not_after":"1970-01-01T00:00:00Z"`, `"bundle_revision":3`, `"keys":null`,
		}},
	} {
		b, err := json.Marshal(c.v)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range c.want {
			if !strings.Contains(string(b), w) {
				t.Errorf("%T encodes as %s; missing %s", c.v, b, w)
			}
		}
	}
	var empty MigrateRequest
	if b, _ := json.Marshal(empty); string(b) != "{}" {
		t.Errorf("empty MigrateRequest encodes as %s, want {} (target_worker is optional)", b)
	}
}
