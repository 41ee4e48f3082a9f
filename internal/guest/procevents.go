package guest

// A started process's events: its output readers publish them and every
// stream subscribed to the process (Start, Connect) gets them, with
// backpressure and the replay a reattached stream needs.

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	processpb "github.com/spacesbx/space/api/envd/process"
)

const (
	// subscriberBuffer is the number of events queued per stream before
	// backpressure reaches the process's output pipes.
	subscriberBuffer = 64
	readBufferSize   = 32 << 10
)

// proc is a process started by the agent.
type proc struct {
	pid   uint32
	tag   *string
	cfg   *processpb.ProcessConfig // as requested, for List
	cmd   *exec.Cmd
	pty   *os.File // PTY master, nil without PTY
	stdin *os.File // stdin pipe write end, nil when stdin was not requested
	// stdinClosed is set by CloseStdin.
	stdinClosed atomic.Bool
	// waited is set once the process has been reaped.
	waited atomic.Bool
	// deadline kills the process when the Start request's Connect timeout
	// (Connect-Timeout-Ms) passes, as envd does; stopped once it is reaped.
	deadline atomic.Pointer[time.Timer]

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	end  *processpb.ProcessEvent // set when the process ended and output is drained
	// detached is output produced while no stream was subscribed, kept
	// for the next Connect (at most detachLimit bytes; 0: none kept).
	detachLimit   int
	detached      []*processpb.ProcessEvent
	detachedBytes int
	dropped       uint64 // bytes of detached output dropped (oldest first)
}

type subscriber struct {
	ch   chan *processpb.ProcessEvent // closed after the end event
	done chan struct{}                // closed by unsubscribe
}

// subscribe registers a new stream. If the process already ended, it returns
// the end event instead.
func (p *proc) subscribe() (*subscriber, *processpb.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		return nil, p.end
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer), done: make(chan struct{})}
	p.subs[sub] = struct{}{}
	return sub, nil
}

// reattach is subscribe for process.Process/Connect: it also takes the
// output kept while nobody was subscribed (Config.DetachedOutputBytes),
// to be sent before anything else, and how many bytes of it were dropped.
func (p *proc) reattach() (*subscriber, *processpb.ProcessEvent, []*processpb.ProcessEvent, uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	kept, dropped := p.detached, p.dropped
	p.detached, p.detachedBytes, p.dropped = nil, 0, 0
	if p.end != nil {
		return nil, p.end, kept, dropped
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer), done: make(chan struct{})}
	p.subs[sub] = struct{}{}
	return sub, nil, kept, dropped
}

func (p *proc) unsubscribe(sub *subscriber) {
	if sub == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.subs[sub]; ok {
		delete(p.subs, sub)
		close(sub.done)
		p.rescueLocked(sub)
	}
}

// rescueLocked moves what sub had queued but its stream never sent into
// the detached output, when sub was the last subscriber.
func (p *proc) rescueLocked(sub *subscriber) {
	if p.detachLimit <= 0 || len(p.subs) > 0 {
		return
	}
	for {
		select {
		case ev, ok := <-sub.ch:
			if !ok {
				return
			}
			p.keepLocked(ev)
		default:
			return
		}
	}
}

// keepLocked keeps a data event produced while nobody is subscribed,
// dropping the oldest kept output beyond Config.DetachedOutputBytes.
func (p *proc) keepLocked(ev *processpb.ProcessEvent) {
	if p.detachLimit <= 0 || ev.GetData() == nil {
		return
	}
	p.detached = append(p.detached, ev)
	p.detachedBytes += dataLen(ev)
	for p.detachedBytes > p.detachLimit && len(p.detached) > 0 {
		n := dataLen(p.detached[0])
		p.detached[0] = nil
		p.detached = p.detached[1:]
		p.detachedBytes -= n
		p.dropped += uint64(n)
	}
}

func dataLen(ev *processpb.ProcessEvent) int {
	d := ev.GetData()
	return len(d.GetStdout()) + len(d.GetStderr()) + len(d.GetPty())
}

// publish delivers ev to every current subscriber, blocking while a live
// subscriber's queue is full (backpressure), never after it unsubscribed.
// Without subscribers, data is kept for the next Connect when
// Config.DetachedOutputBytes is set, and dropped otherwise.
func (p *proc) publish(ev *processpb.ProcessEvent) {
	p.mu.Lock()
	if len(p.subs) == 0 {
		p.keepLocked(ev)
		p.mu.Unlock()
		return
	}
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
			select {
			case <-s.done: // queued after the stream went away
				p.mu.Lock()
				p.rescueLocked(s)
				p.mu.Unlock()
			default:
			}
		case <-s.done:
			p.mu.Lock()
			if len(p.subs) == 0 {
				p.keepLocked(ev)
			}
			p.mu.Unlock()
		}
	}
}

// requeue puts kept output a Connect could not send back in front of the
// detached output, for the next Connect.
func (p *proc) requeue(evs []*processpb.ProcessEvent) {
	if len(evs) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	rest := p.detached
	p.detached, p.detachedBytes = nil, 0
	for _, ev := range append(append([]*processpb.ProcessEvent(nil), evs...), rest...) {
		p.keepLocked(ev)
	}
}

// finish publishes the end event and closes every subscriber queue. Called
// once, by the waiter, after all readers returned.
func (p *proc) finish(end *processpb.ProcessEvent) {
	p.publish(end)
	p.mu.Lock()
	p.end = end
	for s := range p.subs {
		close(s.ch)
	}
	p.mu.Unlock()
}

// signal sends sig to the process group of the process (the process leads
// its own group or session), falling back to the process itself.
func (p *proc) signal(sig syscall.Signal) error {
	if p.waited.Load() {
		return nil
	}
	if err := unix.Kill(-int(p.pid), sig); err == nil {
		return nil
	}
	err := p.cmd.Process.Signal(sig)
	if errors.Is(err, os.ErrProcessDone) {
		return nil
	}
	return err
}

func (p *proc) kill() { _ = p.signal(syscall.SIGKILL) }

func dataEvent(kind int, b []byte) *processpb.ProcessEvent {
	d := &processpb.ProcessEvent_DataEvent{}
	switch kind {
	case 1:
		d.Output = &processpb.ProcessEvent_DataEvent_Stdout{Stdout: b}
	case 2:
		d.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: b}
	default:
		d.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: b}
	}
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
}

func startEvent(pid uint32) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}
}

func keepaliveEvent() *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}
}

// readLoop publishes what f yields until EOF, an error, or the end of the
// process's stream (see waitProcess): a full drainGrace period without
// output after the process exited, or stop. It reports whether f may still
// have writers, i.e. it did not end at EOF or on an error.
func (p *proc) readLoop(f *os.File, kind int, stop *atomic.Bool) (open bool) {
	buf := make([]byte, readBufferSize)
	rearmed := false
	for {
		n, err := f.Read(buf)
		if n > 0 {
			rearmed = false
			p.publish(dataEvent(kind, bytes.Clone(buf[:n])))
		}
		if err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				return false
			}
			if !rearmed && !stop.Load() {
				// The deadline may have expired while we were publishing:
				// give buffered or still-arriving output one fresh period.
				rearmed = true
				if f.SetReadDeadline(time.Now().Add(drainGrace)) == nil {
					continue
				}
			}
			return true
		}
	}
}
