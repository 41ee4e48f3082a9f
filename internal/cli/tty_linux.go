package cli

import (
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// ttyTerminal is a local terminal on a file descriptor.
type ttyTerminal struct{ fd int }

// stdinTerminal returns the terminal on stdin, or nil if stdin is not one.
func stdinTerminal() terminal {
	fd := int(os.Stdin.Fd())
	if _, err := unix.IoctlGetTermios(fd, unix.TCGETS); err != nil {
		return nil
	}
	return ttyTerminal{fd: fd}
}

func (t ttyTerminal) Size() (uint32, uint32, error) {
	ws, err := unix.IoctlGetWinsize(int(os.Stdout.Fd()), unix.TIOCGWINSZ)
	if err != nil {
		ws, err = unix.IoctlGetWinsize(t.fd, unix.TIOCGWINSZ)
		if err != nil {
			return 0, 0, err
		}
	}
	return uint32(ws.Row), uint32(ws.Col), nil
}

// MakeRaw sets raw mode the way golang.org/x/term does (cfmakeraw).
func (t ttyTerminal) MakeRaw() (func(), error) {
	old, err := unix.IoctlGetTermios(t.fd, unix.TCGETS)
	if err != nil {
		return nil, err
	}
	raw := *old
	raw.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	raw.Oflag &^= unix.OPOST
	raw.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	raw.Cflag &^= unix.CSIZE | unix.PARENB
	raw.Cflag |= unix.CS8
	raw.Cc[unix.VMIN] = 1
	raw.Cc[unix.VTIME] = 0
	if err := unix.IoctlSetTermios(t.fd, unix.TCSETS, &raw); err != nil {
		return nil, err
	}
	return func() { _ = unix.IoctlSetTermios(t.fd, unix.TCSETS, old) }, nil
}

func (t ttyTerminal) Resized() (<-chan struct{}, func()) {
	sig := make(chan os.Signal, 1)
	out := make(chan struct{}, 1)
	done := make(chan struct{})
	signal.Notify(sig, syscall.SIGWINCH)
	go func() {
		defer close(out)
		for {
			select {
			case <-sig:
				select {
				case out <- struct{}{}:
				default:
				}
			case <-done:
				return
			}
		}
	}()
	return out, func() { signal.Stop(sig); close(done) }
}

// isTerminal says f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
