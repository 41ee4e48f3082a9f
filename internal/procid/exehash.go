package procid

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// exeKey names one content of an executable file: its device and inode
// and what a stat says about its content (any write changes the size, the
// mtime or the ctime, and userspace cannot set the ctime).
type exeKey struct {
	dev, ino uint64
	meta     exeMeta
}

// exeHashCache remembers the SHA-256 of executables already hashed by this
// process, so that recording the thousandth spaced-host or agent started
// from the same binary does not read and hash 10 MB again (milliseconds of
// CPU on every sandbox start). Bounded; an entry is only found for a file
// whose device, inode, size, mtime and ctime are all unchanged.
type exeHashCache struct {
	mu sync.Mutex
	m  map[exeKey]string
}

const exeHashCacheMax = 64

var exeHashes = &exeHashCache{m: map[exeKey]string{}}

func (c *exeHashCache) get(k exeKey) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.m[k]
	return s, ok
}

func (c *exeHashCache) put(k exeKey, sum string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= exeHashCacheMax {
		clear(c.m)
	}
	c.m[k] = sum
}

// hashOpen hashes the open file f, which must be the file key names, and
// checks that it did not change while it was read.
func hashOpen(f *os.File, key exeKey) (string, error) {
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("hash: %w", err)
	}
	var s unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &s); err != nil {
		return "", fmt.Errorf("stat: %w", err)
	}
	if (exeKey{dev: uint64(s.Dev), ino: s.Ino, meta: exeMeta{size: s.Size, mtime: s.Mtim, ctime: s.Ctim}}) != key {
		return "", fmt.Errorf("%w: file changed while hashing", ErrMismatch)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	exeHashes.put(key, sum)
	return sum, nil
}

// ExeHash returns a statement of the SHA-256 of the executable at path, as
// of now, for PrimeExeHash in a process this one launches: device, inode,
// size, mtime, ctime and the hash (from this process's cache when the file
// is unchanged since it was last hashed here).
func ExeHash(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("procid: %w", err)
	}
	defer f.Close()
	var s unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &s); err != nil {
		return "", fmt.Errorf("procid: stat %s: %w", path, err)
	}
	key := exeKey{dev: uint64(s.Dev), ino: s.Ino, meta: exeMeta{size: s.Size, mtime: s.Mtim, ctime: s.Ctim}}
	sum, ok := exeHashes.get(key)
	if !ok {
		if sum, err = hashOpen(f, key); err != nil {
			return "", fmt.Errorf("procid: %s: %w", path, err)
		}
	}
	return strings.Join([]string{
		strconv.FormatUint(key.dev, 10), strconv.FormatUint(key.ino, 10), strconv.FormatInt(key.meta.size, 10),
		strconv.FormatInt(key.meta.mtime.Nano(), 10), strconv.FormatInt(key.meta.ctime.Nano(), 10), sum,
	}, ":"), nil
}

// PrimeExeHash records a statement made by ExeHash in the process that
// launched this one (a trusted parent: sbx-manager for spaced-host), so
// that recording a process whose executable is exactly that file (same
// device, inode, size, mtime and ctime) does not hash it again. A process
// whose executable differs in any of them is hashed as usual.
func PrimeExeHash(stmt string) error {
	f := strings.Split(stmt, ":")
	if len(f) != 6 || len(f[5]) != 2*sha256.Size {
		return fmt.Errorf("procid: malformed executable hash statement %q", stmt)
	}
	if _, err := hex.DecodeString(f[5]); err != nil {
		return fmt.Errorf("procid: malformed executable hash statement: %w", err)
	}
	var u [2]uint64
	var n [3]int64
	var err error
	for i := range u {
		if u[i], err = strconv.ParseUint(f[i], 10, 64); err != nil {
			return fmt.Errorf("procid: malformed executable hash statement: %w", err)
		}
	}
	for i := range n {
		if n[i], err = strconv.ParseInt(f[2+i], 10, 64); err != nil {
			return fmt.Errorf("procid: malformed executable hash statement: %w", err)
		}
	}
	key := exeKey{dev: u[0], ino: u[1], meta: exeMeta{size: n[0], mtime: unix.NsecToTimespec(n[1]), ctime: unix.NsecToTimespec(n[2])}}
	exeHashes.put(key, f[5])
	return nil
}
