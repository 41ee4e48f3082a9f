package bridge

// The checks of the package doc: what the bridge records at start and the
// transport checks (1-4) every guest connection passes.

import (
	"context"
	"fmt"
	"net"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/procid"
)

// record takes what later connections are compared with: the agent
// process, the path's inode and the listening socket bound at it.
func (b *Bridge) record() error {
	pid := b.cfg.GuestPID
	h, err := procid.Open(pid)
	if err != nil {
		return fmt.Errorf("bridge: guest process: %w", err)
	}
	b.guest = h
	var st unix.Stat_t
	if err := unix.Stat(b.cfg.GuestSocket, &st); err != nil {
		return fmt.Errorf("bridge: guest socket: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("bridge: guest socket %s is not a socket", b.cfg.GuestSocket)
	}
	b.pathDev, b.pathIno = uint64(st.Dev), st.Ino
	if b.diagGuest, err = procid.NewDiagInNetns(pid); err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	if same, err := procid.SameNetns(pid); err != nil {
		return fmt.Errorf("bridge: %w", err)
	} else if same {
		b.diagSelf = b.diagGuest
	} else if b.diagSelf, err = procid.NewDiag(); err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	socks, err := b.diagGuest.Dump(1<<procid.StateListen, procid.UDiagShowVFS)
	if err != nil {
		return fmt.Errorf("bridge: sock_diag: %w", err)
	}
	for _, s := range socks {
		if b.boundAtPath(s) {
			if b.listener != 0 {
				return verr(CheckListener, "%w: two listeners at %s", ErrListener, b.cfg.GuestSocket)
			}
			b.listener = s.Ino
		}
	}
	if b.listener == 0 {
		return verr(CheckListener, "%w: no listener bound at %s in the agent's network namespace", ErrListener, b.cfg.GuestSocket)
	}
	fd, err := procid.FindSocketFD(pid, b.listener, -1)
	if err != nil {
		return verr(CheckListener, "%w: %v", ErrListener, err)
	}
	b.listenerFD.Store(int32(fd))
	// The fds read above were the recorded process's if it is alive now.
	if err := h.Check(); err != nil {
		return verr(CheckPeerProcess, "%w", err)
	}
	return nil
}

func (b *Bridge) boundAtPath(s procid.UnixSocket) bool {
	return s.HasVFS && s.VFSIno == uint32(b.pathIno) && s.VFSDev == procid.KernelDev(b.pathDev)
}

// verifyTransport runs the transport checks (1-4) on a new guest connection.
func (b *Bridge) verifyTransport(c net.Conn) error {
	pid := b.cfg.GuestPID
	fd, err := procid.FindSocketFD(pid, b.listener, int(b.listenerFD.Load()))
	if err != nil {
		return verr(CheckListener, "%w: %v", ErrListener, err)
	}
	b.listenerFD.Store(int32(fd))
	if !b.cfg.noSockDiag {
		if err := b.verifyPeerSocket(c); err != nil {
			return err
		}
	}
	if err := b.guest.VerifyPeer(c); err != nil {
		return &VerifyError{Check: CheckPeerProcess, Err: err}
	}
	return nil
}

// verifyPeerSocket asks sock_diag whether c went through the recorded
// listener: either our socket waits in its accept queue, or the agent has
// accepted it and our peer is bound at the recorded path inode and names
// our socket as its peer.
func (b *Bridge) verifyPeerSocket(c net.Conn) error {
	own, err := procid.ConnInode(c)
	if err != nil {
		return verr(CheckPeerSocket, "%w", err)
	}
	for attempt := 0; ; attempt++ {
		ls, err := b.diagGuest.Lookup(b.listener, procid.UDiagShowVFS|procid.UDiagShowIcons)
		if err != nil {
			return verr(CheckListener, "%w: listener %d: %v", ErrListener, b.listener, err)
		}
		if ls.State != procid.StateListen || !b.boundAtPath(ls) {
			return verr(CheckListener, "%w: socket %d no longer listens at the recorded path inode", ErrListener, b.listener)
		}
		if slices.Contains(ls.Icons, own) {
			return nil
		}
		me, err := b.diagSelf.Lookup(own, procid.UDiagShowPeer)
		if err != nil || !me.HasPeer {
			return verr(CheckPeerSocket, "%w: own socket %d: %v", ErrListener, own, err)
		}
		if me.Peer != 0 {
			// The kernel creates the server side of a Unix connection in
			// the connecting socket's network namespace (ours), not the
			// listener's; look there first.
			p, err := b.diagSelf.Lookup(me.Peer, procid.UDiagShowVFS|procid.UDiagShowPeer)
			if err != nil {
				p, err = b.diagGuest.Lookup(me.Peer, procid.UDiagShowVFS|procid.UDiagShowPeer)
			}
			if err != nil && attempt < 50 {
				// Between dequeue and graft by accept(2): not yet findable.
				time.Sleep(100 * time.Microsecond)
				continue
			}
			if err != nil {
				return verr(CheckPeerSocket, "%w: peer socket %d not found: %v", ErrListener, me.Peer, err)
			}
			if !b.boundAtPath(p) || p.Peer != own {
				return verr(CheckPeerSocket, "%w: peer socket %d is bound at %d:%d, not at the recorded path inode", ErrListener, me.Peer, p.VFSDev, p.VFSIno)
			}
			return nil
		}
		// Dequeued but not yet given an inode by accept(2): a moment.
		if attempt == 50 {
			return verr(CheckPeerSocket, "%w: connection neither queued nor accepted", ErrListener)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// checkPath is the path-inode check.
func (b *Bridge) checkPath() error {
	var st unix.Stat_t
	if err := unix.Stat(b.cfg.GuestSocket, &st); err != nil {
		return verr(CheckPathInode, "%w: %v", ErrSocketPath, err)
	}
	if uint64(st.Dev) != b.pathDev || st.Ino != b.pathIno {
		return verr(CheckPathInode, "%w: %s is inode %d:%d, recorded %d:%d",
			ErrSocketPath, b.cfg.GuestSocket, st.Dev, st.Ino, b.pathDev, b.pathIno)
	}
	return nil
}

// dialVerified dials the guest socket and runs the transport checks on
// the new connection.
func (b *Bridge) dialVerified(ctx context.Context) (net.Conn, error) {
	if err := b.checkPath(); err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", b.cfg.GuestSocket)
	if err != nil {
		return nil, fmt.Errorf("bridge: dial guest: %w", err)
	}
	if err := b.verifyTransport(c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
