package store

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/spacesbx/space/internal/errdefs"
)

// Elections (etcd's concurrency package) choose the one process that runs
// what must run once in a cluster: /space/elections/<name>/<lease> holds a
// candidate; the oldest candidate leads. A candidate's key lives under its
// session's lease, so a leader that crashed is replaced within the lease's
// TTL, and one that resigns (Close) at once. (The events recorder's
// election predates this layout and stays under /space/events/leader.)
const electionsPrefix = prefix + "elections/"

// ErrNotLeader: a write guarded by a Leadership found it lost. It is an
// errdefs.ErrConflict.
var ErrNotLeader = errdefs.Message(errdefs.ErrConflict, "leadership lost")

// MinElectionTTL is the shortest lease an election accepts (etcd's TTLs
// are whole seconds).
const MinElectionTTL = time.Second

var electionName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

// Leadership is this process's turn as the leader of one election. Writes
// guarded by it fail with ErrNotLeader once another process holds the
// election.
type Leadership struct {
	sess *concurrency.Session
	el   *concurrency.Election
	key  string
	rev  int64
}

// Campaign blocks until this process (named id, e.g. its instance name)
// leads the election name (lower-case letters, digits and '-') or ctx
// ends. The leadership lasts while the process keeps its etcd lease (ttl,
// at least MinElectionTTL, rounded down to whole seconds): a crashed
// leader is replaced within ttl. Done reports the loss; Close resigns.
func (s *Store) Campaign(ctx context.Context, name, id string, ttl time.Duration) (*Leadership, error) {
	if !electionName.MatchString(name) {
		return nil, fmt.Errorf("store: campaign: %w: election name %q", errdefs.ErrInvalid, name)
	}
	if id == "" || len(id) > 253 {
		return nil, fmt.Errorf("store: campaign: %w: candidate id must be 1..253 bytes", errdefs.ErrInvalid)
	}
	if ttl < MinElectionTTL {
		return nil, fmt.Errorf("store: campaign: %w: ttl %s below %s", errdefs.ErrInvalid, ttl, MinElectionTTL)
	}
	return s.campaign(ctx, electionsPrefix+name, id, ttl)
}

func (s *Store) campaign(ctx context.Context, pfx, id string, ttl time.Duration) (*Leadership, error) {
	secs := max(int(ttl/time.Second), 1)
	sess, err := concurrency.NewSession(s.cli, concurrency.WithTTL(secs), concurrency.WithContext(context.WithoutCancel(ctx)))
	if err != nil {
		return nil, wrapErr("election session", err)
	}
	el := concurrency.NewElection(sess, pfx)
	if err := el.Campaign(ctx, id); err != nil {
		_ = sess.Close()
		return nil, wrapErr("campaign", err)
	}
	return &Leadership{sess: sess, el: el, key: el.Key(), rev: el.Rev()}, nil
}

// Leader returns the id of the current leader of election name, or
// errdefs.ErrNotFound when nobody campaigns.
func (s *Store) Leader(ctx context.Context, name string) (string, error) {
	if !electionName.MatchString(name) {
		return "", fmt.Errorf("store: leader: %w: election name %q", errdefs.ErrInvalid, name)
	}
	resp, err := s.cli.Get(ctx, electionsPrefix+name+"/", clientv3.WithFirstCreate()...)
	if err != nil {
		return "", wrapErr("leader", err)
	}
	if len(resp.Kvs) == 0 {
		return "", fmt.Errorf("store: leader of %s: %w", name, errdefs.ErrNotFound)
	}
	return string(resp.Kvs[0].Value), nil
}

// Done is closed when the leadership's lease is lost (it expired: this
// process could not reach etcd for the TTL) or Close ended it.
func (l *Leadership) Done() <-chan struct{} { return l.sess.Done() }

// Check reports ErrNotLeader when this process no longer leads (its key is
// gone), or an error when etcd cannot tell.
func (l *Leadership) Check(ctx context.Context) error {
	resp, err := l.sess.Client().Txn(ctx).If(l.cmp()).Commit()
	if err != nil {
		return wrapErr("leadership check", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("store: %w", ErrNotLeader)
	}
	return nil
}

// Close resigns and ends the lease (another process takes over at once).
func (l *Leadership) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := l.el.Resign(ctx)
	if cerr := l.sess.Close(); err == nil {
		err = cerr
	}
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	return err
}

func (l *Leadership) cmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)
}
