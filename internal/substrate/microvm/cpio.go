package microvm

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
)

// cpioWriter writes the SVR4 "newc" cpio format the kernel unpacks as an
// initramfs. Every entry gets mtime 0 and a fresh inode number, so the
// same inputs always give the same bytes (the image cache relies on it).
//
// It is hand-written rather than github.com/cavaliergopher/cpio (v1.0.1)
// because that library cannot express device nodes: its Header has no
// rdev fields and its newc writer always writes rdevmajor/rdevminor 0. The
// image's dev/console (5,1) and dev/null (1,3) would become 0:0 nodes, and
// the kernel, which opens /dev/console on the initramfs before it runs
// /init (init mounts devtmpfs only later), would start init without
// stdin, stdout and stderr.
type cpioWriter struct {
	w    io.Writer
	off  int64
	ino  uint32
	seen map[string]bool
	err  error
	// closing is set while Close writes the trailer (an entry of that
	// name would end the archive early otherwise).
	closing bool
}

func newCPIOWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: w, ino: 1, seen: map[string]bool{}}
}

// cpio mode type bits (as in <sys/stat.h>).
const (
	cpioDir     = 0o040000
	cpioReg     = 0o100000
	cpioSymlink = 0o120000
	cpioChar    = 0o020000
)

func (c *cpioWriter) write(p []byte) {
	if c.err != nil {
		return
	}
	n, err := c.w.Write(p)
	c.off += int64(n)
	c.err = err
}

func (c *cpioWriter) pad() {
	if r := c.off % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

func (c *cpioWriter) header(name string, mode uint32, uid, gid uint32, size int64, rmajor, rminor uint32) error {
	if c.err != nil {
		return c.err
	}
	if !c.closing {
		if name == "" || name == "TRAILER!!!" || strings.HasPrefix(name, "/") || strings.Contains(name, "\x00") ||
			name == "." || name == ".." || strings.HasPrefix(name, "../") || strings.Contains(name, "/../") || strings.HasSuffix(name, "/..") {
			return fmt.Errorf("cpio: bad entry name %q", name)
		}
		if c.seen[name] {
			return fmt.Errorf("cpio: duplicate entry %q", name)
		}
		c.seen[name] = true
	}
	if size < 0 || size > 0xffffffff {
		return fmt.Errorf("cpio: %s: size %d does not fit the newc format", name, size)
	}
	nlink := uint32(1)
	if mode&0o170000 == cpioDir {
		nlink = 2
	}
	ino := c.ino
	c.ino++
	h := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, mode, uid, gid, nlink, 0, uint32(size), 0, 0, rmajor, rminor, len(name)+1, 0)
	c.write([]byte(h))
	c.write([]byte(name + "\x00"))
	c.pad()
	return c.err
}

// Dir adds a directory.
func (c *cpioWriter) Dir(name string, perm fs.FileMode, uid, gid uint32) error {
	return c.header(name, cpioDir|modeBits(perm), uid, gid, 0, 0, 0)
}

// File adds a regular file of exactly size bytes read from r.
func (c *cpioWriter) File(name string, perm fs.FileMode, uid, gid uint32, size int64, r io.Reader) error {
	if err := c.header(name, cpioReg|modeBits(perm), uid, gid, size, 0, 0); err != nil {
		return err
	}
	n, err := io.Copy(writerFunc(func(p []byte) (int, error) { c.write(p); return len(p), c.err }), io.LimitReader(r, size))
	if err != nil {
		return err
	}
	if n != size {
		return fmt.Errorf("cpio: %s: got %d of %d bytes", name, n, size)
	}
	c.pad()
	return c.err
}

// Bytes adds a regular file with content b.
func (c *cpioWriter) Bytes(name string, perm fs.FileMode, b []byte) error {
	return c.File(name, perm, 0, 0, int64(len(b)), strings.NewReader(string(b)))
}

// Symlink adds a symbolic link name -> target.
func (c *cpioWriter) Symlink(name, target string) error {
	if target == "" {
		return errors.New("cpio: empty symlink target")
	}
	if err := c.header(name, cpioSymlink|0o777, 0, 0, int64(len(target)), 0, 0); err != nil {
		return err
	}
	c.write([]byte(target))
	c.pad()
	return c.err
}

// CharDev adds a character device node.
func (c *cpioWriter) CharDev(name string, perm fs.FileMode, major, minor uint32) error {
	return c.header(name, cpioChar|modeBits(perm), 0, 0, 0, major, minor)
}

// Close writes the trailer. It does not close the underlying writer.
func (c *cpioWriter) Close() error {
	c.closing = true
	if err := c.header("TRAILER!!!", 0, 0, 0, 0, 0, 0); err != nil {
		return err
	}
	// Pad the archive to 512 bytes like cpio(1) does.
	if r := c.off % 512; r != 0 {
		c.write(make([]byte, 512-r))
	}
	return c.err
}

// modeBits maps fs.FileMode permission and special bits to st_mode bits.
func modeBits(m fs.FileMode) uint32 {
	b := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
