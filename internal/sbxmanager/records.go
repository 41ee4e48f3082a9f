package sbxmanager

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
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
	// restoreState is the VM state file an install restores (microvm);
	// not persisted.
	restoreState string
}

// recordStore persists runtime records in bbolt.
type recordStore struct{ db *bolt.DB }

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
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketRecords).Put([]byte(r.Route.SandboxID), b)
	})
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
