package sbxmanager

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"github.com/spacesbx/space/internal/identity"
)

// Concurrent puts are group-committed; each returns only once its record
// is committed: all of them are there after the store is reopened, with
// the last value written for each sandbox.
func TestRecordStoreConcurrentPutsAreDurable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "records.db")
	st, err := openRecords(path)
	if err != nil {
		t.Fatal(err)
	}
	const sandboxes, rounds = 40, 3
	var wg sync.WaitGroup
	errs := make(chan error, sandboxes*rounds)
	for i := range sandboxes {
		wg.Go(func() {
			for g := range rounds {
				r := record{Record: identity.Record{Route: identity.Route{SandboxID: fmt.Sprintf("sbx%02d", i), Generation: uint64(g + 1)}}}
				if err := st.put(r); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := st.close(); err != nil {
		t.Fatal(err)
	}
	st, err = openRecords(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.close()
	recs, err := st.loadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != sandboxes {
		t.Fatalf("%d records, want %d", len(recs), sandboxes)
	}
	for id, r := range recs {
		if r.Route.Generation != rounds {
			t.Errorf("%s: generation %d, want %d (the last put)", id, r.Route.Generation, rounds)
		}
	}
}

// A put on a closed store fails (it is never acknowledged unwritten).
func TestRecordStorePutAfterCloseFails(t *testing.T) {
	st, err := openRecords(filepath.Join(t.TempDir(), "records.db"))
	if err != nil {
		t.Fatal(err)
	}
	st.close()
	if err := st.put(record{Record: identity.Record{Route: identity.Route{SandboxID: "sbx", Generation: 1}}}); err == nil {
		t.Fatal("put on a closed store succeeded")
	}
}
