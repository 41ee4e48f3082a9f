//go:build linux

package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"

	"golang.org/x/sys/unix"
)

// qmp is a minimal QMP (QEMU Machine Protocol) client over a connected
// Unix socket: greeting and capabilities negotiation, one command at a
// time (matched by id), optional file descriptors passed with a command
// (SCM_RIGHTS, for getfd), events kept in a small ring for diagnostics.
type qmp struct {
	conn *net.UnixConn

	cmdMu sync.Mutex // one command in flight
	next  int

	mu      sync.Mutex
	waiters map[string]chan qmpReply
	events  []qmpEvent // last maxEvents events
	err     error      // set when the reader ends

	greeted chan struct{}
	done    chan struct{} // closed when the reader ends
	wg      sync.WaitGroup
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

const maxEvents = 32

// newQMP starts the reader on conn, waits for the greeting and negotiates
// capabilities. conn belongs to the client from then on (Close closes it).
func newQMP(ctx context.Context, conn *net.UnixConn) (*qmp, error) {
	q := &qmp{conn: conn, waiters: map[string]chan qmpReply{}, greeted: make(chan struct{}), done: make(chan struct{})}
	q.wg.Add(1)
	go q.read()
	select {
	case <-q.greeted:
	case <-q.done:
		q.Close()
		return nil, fmt.Errorf("qmp: no greeting: %w", q.readErr())
	case <-ctx.Done():
		q.Close()
		return nil, fmt.Errorf("qmp: no greeting: %w", ctx.Err())
	}
	if _, err := q.execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmp) readErr() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.err
}

func (q *qmp) read() {
	defer q.wg.Done()
	defer close(q.done)
	dec := json.NewDecoder(q.conn)
	greeted := false
	for {
		var m struct {
			QMP json.RawMessage `json:"QMP"`
			ID  *string         `json:"id"`
			qmpReply
			qmpEvent
		}
		if err := dec.Decode(&m); err != nil {
			q.mu.Lock()
			q.err = fmt.Errorf("qmp: connection closed: %w", err)
			for id, ch := range q.waiters {
				close(ch)
				delete(q.waiters, id)
			}
			q.mu.Unlock()
			return
		}
		switch {
		case m.QMP != nil:
			if !greeted {
				greeted = true
				close(q.greeted)
			}
		case m.Event != "":
			q.mu.Lock()
			q.events = append(q.events, m.qmpEvent)
			if len(q.events) > maxEvents {
				q.events = q.events[len(q.events)-maxEvents:]
			}
			q.mu.Unlock()
		case m.ID != nil:
			q.mu.Lock()
			if ch, ok := q.waiters[*m.ID]; ok {
				ch <- m.qmpReply
				delete(q.waiters, *m.ID)
			}
			q.mu.Unlock()
		}
	}
}

// execute runs one command and returns its "return" value. fds, when set,
// travel with the command (SCM_RIGHTS) as getfd and add-fd expect.
func (q *qmp) execute(ctx context.Context, cmd string, args any, fds []int) (json.RawMessage, error) {
	q.cmdMu.Lock()
	defer q.cmdMu.Unlock()
	q.next++
	id := fmt.Sprintf("c%d", q.next)
	msg := map[string]any{"execute": cmd, "id": id}
	if args != nil {
		msg["arguments"] = args
	}
	b, err := json.Marshal(msg)
	if err != nil {
		return nil, err
	}
	ch := make(chan qmpReply, 1)
	q.mu.Lock()
	if q.err != nil {
		err := q.err
		q.mu.Unlock()
		return nil, err
	}
	q.waiters[id] = ch
	q.mu.Unlock()
	drop := func() {
		q.mu.Lock()
		delete(q.waiters, id)
		q.mu.Unlock()
	}
	if len(fds) > 0 {
		_, _, err = q.conn.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	} else {
		_, err = q.conn.Write(b)
	}
	if err != nil {
		drop()
		return nil, fmt.Errorf("qmp: %s: %w", cmd, err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("qmp: %s: %w", cmd, q.readErr())
		}
		if r.Error != nil {
			return nil, fmt.Errorf("qmp: %s: %s: %s", cmd, r.Error.Class, r.Error.Desc)
		}
		return r.Return, nil
	case <-ctx.Done():
		drop() // a late reply is dropped by the reader
		return nil, fmt.Errorf("qmp: %s: %w", cmd, ctx.Err())
	}
}

// status returns the VM's run state ("running", "paused", "postmigrate",
// "inmigrate", ...).
func (q *qmp) status(ctx context.Context) (string, error) {
	r, err := q.execute(ctx, "query-status", nil, nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(r, &st); err != nil {
		return "", fmt.Errorf("qmp: query-status: %w", err)
	}
	return st.Status, nil
}

// migrateStatus is the part of query-migrate the substrate reads.
type migrateStatus struct {
	Status string `json:"status"`
	Error  string `json:"error-desc"`
	RAM    struct {
		Transferred int64 `json:"transferred"`
	} `json:"ram"`
}

func (q *qmp) migrateStatus(ctx context.Context) (migrateStatus, error) {
	var st migrateStatus
	r, err := q.execute(ctx, "query-migrate", nil, nil)
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(r, &st); err != nil {
		return st, fmt.Errorf("qmp: query-migrate: %w", err)
	}
	return st, nil
}

// recentEvents returns the names of the last events, oldest first.
func (q *qmp) recentEvents() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []string
	for _, e := range q.events {
		out = append(out, e.Event)
	}
	return out
}

// Close closes the connection and waits for the reader.
func (q *qmp) Close() error {
	err := q.conn.Close()
	q.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
