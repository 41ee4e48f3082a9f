package sbxmanager

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
)

var bucketRecords = []byte("records")

// record is what a worker persists about an execution it serves. It is
// written (and fsynced) before an install is acknowledged, so a restarted
// manager knows which executions it may serve and which are retired.
type record struct {
	identity.Record
	Template  string            `json:"template"`
	EnvVars   map[string]string `json:"env_vars,omitempty"`
	Limits    spacev1.Limits    `json:"limits"`
	Dir       string            `json:"dir"`
	Installed time.Time         `json:"installed"`
	// Host is the spaced-host serving the activation, as recorded at its
	// launch (pid, start time, executable and its SHA-256): a restarted
	// manager adopts the activation only through exactly that process.
	Host procid.Process `json:"host"`
	// Adopt is what the substrate needs to adopt the activation's
	// instance after a restart (substrate.Adoptable.AdoptState); empty
	// for a substrate without adoption.
	Adopt json.RawMessage `json:"adopt,omitempty"`
	// Network is the execution's egress policy as the control plane sent
	// it (secrets resolved: the state dir is the worker's, mode 0700);
	// Link the link it was given. Both nil: loopback only.
	Network *spacev1.Network `json:"network,omitempty"`
	// Image is the OCI image the root file system comes from (nil: the
	// template's own); kept so a restart or restore resolves it again.
	Image *spacev1.ImageSource `json:"image,omitempty"`
	Link  *Link                `json:"link,omitempty"`
	// Volumes are the team volumes the execution mounts.
	Volumes []spacev1.VolumeMount `json:"volumes,omitempty"`
	// restoreState is the instance state file an install restores (a
	// substrate that saves state); not persisted.
	restoreState string
}

// recordStore persists runtime records in bbolt.
//
// Puts are group-committed: a put that finds no commit running commits at
// once (no delay); the puts that arrive while a commit runs are written
// together in the next transaction, one fsync for all of them. Every put
// returns only after the transaction holding it has committed (bbolt
// fsyncs on commit), so an acknowledged record is durable as before; under
// concurrent installs the fsyncs no longer queue one behind the other.
type recordStore struct {
	db *bolt.DB

	mu         sync.Mutex
	pending    []pendingPut
	committing bool
}

type pendingPut struct {
	key, val []byte
	done     chan error
}

func openRecords(path string) (*recordStore, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open runtime records %s: %w", path, err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bucketRecords)
		return err
	}); err != nil {
		db.Close()
		return nil, fmt.Errorf("init runtime records: %w", err)
	}
	return &recordStore{db: db}, nil
}

func (s *recordStore) put(r record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	p := pendingPut{key: []byte(r.Route.SandboxID), val: b, done: make(chan error, 1)}
	s.mu.Lock()
	s.pending = append(s.pending, p)
	lead := !s.committing
	s.committing = true
	s.mu.Unlock()
	if lead {
		// Commit what is pending now (this put included); what arrives
		// meanwhile goes in the next transactions, committed without
		// holding up this put.
		s.commitBatch(s.takePending())
		if next := s.takePending(); len(next) > 0 {
			go func() {
				s.commitBatch(next)
				for b := s.takePending(); len(b) > 0; b = s.takePending() {
					s.commitBatch(b)
				}
			}()
		}
	}
	return <-p.done
}

// takePending returns the pending puts; when there are none, the next put
// leads a commit itself.
func (s *recordStore) takePending() []pendingPut {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.pending
	s.pending = nil
	if len(b) == 0 {
		s.committing = false
	}
	return b
}

func (s *recordStore) commitBatch(batch []pendingPut) {
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketRecords)
		for _, p := range batch {
			if err := b.Put(p.key, p.val); err != nil {
				return err
			}
		}
		return nil
	})
	for _, p := range batch {
		p.done <- err
	}
}

func (s *recordStore) delete(sandbox string) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRecords).Delete([]byte(sandbox))
	})
}

func (s *recordStore) loadAll() (map[string]record, error) {
	out := map[string]record{}
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRecords).ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("record %q: %w", k, err)
			}
			if string(k) != r.Route.SandboxID {
				return errors.New("record key does not match its sandbox")
			}
			out[string(k)] = r
			return nil
		})
	})
	return out, err
}

func (s *recordStore) close() error { return s.db.Close() }
