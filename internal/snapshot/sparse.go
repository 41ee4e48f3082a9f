//go:build linux

package snapshot

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Sparse files.
//
// A regular file with holes (`truncate -s 2G f`: no blocks on disk) is
// archived as an entry of type TypeSparse whose content is only its data
// extents, concatenated in offset order; the PAX record SPACE.sparse
// (sparseRecord) gives the logical size and the extents:
//
//	SPACE.sparse=<logical size>,<offset>,<length>,<offset>,<length>,...
//
// decimal, no signs or leading zeros, extents sorted, non-overlapping,
// non-empty and within the logical size, at most maxExtents of them, their
// lengths summing to the entry's size (the stored bytes). A file that is
// all hole has just "<logical size>". Restore creates the file, writes each
// extent at its offset and truncates it to the logical size, so the holes
// stay holes on the restoring host too.
//
// Why a type of its own rather than TypeReg with a record: a Restore that
// predates sparse entries ignores unknown PAX records, so it would write
// the extents back to back as a shorter file, silently. An unknown type is
// refused by every version ("unsupported entry type"). Files without holes
// stay TypeReg, so archives of such trees are what they always were, and
// archives from before sparse entries restore unchanged.

// TypeSparse is the tar type of a sparse regular file (see above). 'A'-'Z'
// are POSIX's vendor extension types; Y has no other known use.
const TypeSparse byte = 'Y'

const sparseRecord = "SPACE.sparse"

// maxExtents bounds an extent map. Its record (at most about 40 bytes an
// extent) must fit archive/tar's 1 MiB limit on PAX headers; Archive merges
// the closest extents of a file with more (storing the zeros between them).
const maxExtents = 1 << 14

type extent struct{ off, len int64 }

// dataExtents lists the data extents of the open file fd of size bytes
// (SEEK_DATA/SEEK_HOLE). A file system without hole support reports the
// whole file as data, which is also what is returned when seeking fails
// with EINVAL.
func dataExtents(fd int, size int64) ([]extent, error) {
	var ext []extent
	for off := int64(0); off < size; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole from off to the end
		}
		if errors.Is(err, unix.EINVAL) {
			return []extent{{0, size}}, nil
		}
		if err != nil {
			return nil, fmt.Errorf("seek data: %w", err)
		}
		if d >= size {
			break
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("seek hole: %w", err)
		}
		if h > size {
			h = size
		}
		if h <= d {
			// Only a file changing under us gets here; store the rest
			// as data rather than loop.
			h = size
		}
		ext = append(ext, extent{d, h - d})
		off = h
	}
	return mergeExtents(ext, maxExtents), nil
}

// mergeExtents returns ext with at most max extents, filling the smallest
// holes between neighbours (they are then stored as zeros).
func mergeExtents(ext []extent, max int) []extent {
	if len(ext) <= max {
		return ext
	}
	// Fill the len(ext)-max smallest gaps: a gap is filled when it is
	// smaller than the cut-off, or equal to it while quota remains.
	gaps := make([]int64, len(ext)-1)
	for i := range gaps {
		gaps[i] = ext[i+1].off - (ext[i].off + ext[i].len)
	}
	sorted := slices.Clone(gaps)
	slices.Sort(sorted)
	fill := len(ext) - max
	cut := sorted[fill-1]
	atCut := 0
	for _, g := range sorted[:fill] {
		if g == cut {
			atCut++
		}
	}
	out := []extent{ext[0]}
	for i, g := range gaps {
		if g < cut || (g == cut && atCut > 0) {
			if g == cut {
				atCut--
			}
			last := &out[len(out)-1]
			last.len = ext[i+1].off + ext[i+1].len - last.off
			continue
		}
		out = append(out, ext[i+1])
	}
	return out
}

func storedBytes(ext []extent) int64 {
	var n int64
	for _, e := range ext {
		n += e.len
	}
	return n
}

func formatSparse(size int64, ext []extent) string {
	var b strings.Builder
	b.WriteString(strconv.FormatInt(size, 10))
	for _, e := range ext {
		b.WriteByte(',')
		b.WriteString(strconv.FormatInt(e.off, 10))
		b.WriteByte(',')
		b.WriteString(strconv.FormatInt(e.len, 10))
	}
	return b.String()
}

// parseSparse validates a SPACE.sparse record against the entry's stored
// size. It returns a reason instead of an error: every failure is the
// archive's fault.
func parseSparse(v string, stored int64) (int64, []extent, string) {
	if n := strings.Count(v, ","); n%2 != 0 {
		return 0, nil, "sparse map: malformed (odd number of extent fields)"
	} else if n/2 > maxExtents {
		return 0, nil, fmt.Sprintf("sparse map: more than %d extents", maxExtents)
	}
	fields := strings.Split(v, ",")
	num := func(s string) (int64, bool) {
		if s == "" || len(s) > 19 || (len(s) > 1 && s[0] == '0') {
			return 0, false
		}
		for i := 0; i < len(s); i++ {
			if s[i] < '0' || s[i] > '9' {
				return 0, false
			}
		}
		n, err := strconv.ParseInt(s, 10, 64)
		return n, err == nil
	}
	size, ok := num(fields[0])
	if !ok {
		return 0, nil, "sparse map: malformed logical size"
	}
	ext := make([]extent, 0, len(fields)/2)
	var end, sum int64
	for i := 1; i < len(fields); i += 2 {
		off, ok1 := num(fields[i])
		n, ok2 := num(fields[i+1])
		if !ok1 || !ok2 {
			return 0, nil, "sparse map: malformed extent"
		}
		switch {
		case n == 0:
			return 0, nil, "sparse map: empty extent"
		case off < end:
			return 0, nil, "sparse map: extents not sorted or overlapping"
		case off > size || n > size-off: // no overflow: both are <= size
			return 0, nil, "sparse map: extent beyond the logical size"
		}
		end = off + n
		sum += n // <= size, no overflow
		ext = append(ext, extent{off, n})
	}
	if sum != stored {
		return 0, nil, fmt.Sprintf("sparse map: extents hold %d bytes, the entry stores %d", sum, stored)
	}
	return size, ext, ""
}
