//go:build linux

package volume

// Loop devices and the detached ext4 mount. The ns substrate's layer
// disks do the same (internal/substrate/ns/disk.go); this package sits
// below the substrates, so it has its own copy of the few calls, and
// differs where volumes do: a volume's loop device is shared by every
// sandbox of the host, so it is looked up before one is attached.

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	blockSize = 4096
	loopMajor = 7
	// mountData: remount read-only on an I/O error (the host full under a
	// sparse image) rather than go on; discard gives deleted blocks back
	// to the host; noinit_itable keeps the kernel from zeroing the inode
	// tables of the sparse image (they read as zeros already).
	mountData = "errors=remount-ro,discard,noinit_itable"
)

// findLoop returns the loop device attached to the file ist describes
// (open: it stays attached while open) and its number, or nil.
func findLoop(ist unix.Stat_t) (*os.File, uint64, error) {
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return nil, 0, err
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if _, err := os.Stat("/sys/block/" + e.Name() + "/loop/backing_file"); err != nil {
			continue // not attached
		}
		f, err := openLoopNode(e.Name())
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENXIO) {
			continue // removed meanwhile
		}
		if err != nil {
			// Not knowing a device that may back the image would mount it
			// twice: fail instead.
			return nil, 0, fmt.Errorf("inspect %s: %w", e.Name(), err)
		}
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		var st unix.Stat_t
		if err == nil && info.Device == ist.Dev && info.Inode == ist.Ino &&
			unix.Fstat(int(f.Fd()), &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && unix.Major(st.Rdev) == loopMajor {
			return f, st.Rdev, nil
		}
		f.Close()
	}
	return nil, 0, nil
}

// openLoopNode opens /dev/<name> read-only, making the node from sysfs
// when /dev lacks it (a /dev that is not a devtmpfs).
func openLoopNode(name string) (*os.File, error) {
	p := "/dev/" + name
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	b, rerr := os.ReadFile("/sys/block/" + name + "/dev")
	if rerr != nil {
		return nil, err
	}
	var ma, mi uint32
	if _, serr := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &ma, &mi); serr != nil || ma != loopMajor {
		return nil, err
	}
	if merr := unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(ma, mi))); merr != nil && merr != unix.EEXIST {
		return nil, fmt.Errorf("mknod %s: %w", p, merr)
	}
	return os.OpenFile(p, os.O_RDONLY|unix.O_CLOEXEC, 0)
}

// attachLoop binds the image open at fd to a free loop device with
// autoclear (it detaches itself once the last mount is gone) and returns
// it open, with its number.
func attachLoop(fd int) (*os.File, uint64, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("loop driver: %w", err)
	}
	defer ctl.Close()
	cfg := unix.LoopConfig{Fd: uint32(fd), Size: blockSize}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
	var lastErr error
	for attempt := 0; attempt < 64; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, 0, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
		}
		name := fmt.Sprintf("/dev/loop%d", n)
		loop, err := os.OpenFile(name, os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			lastErr = err
			if errors.Is(err, os.ErrNotExist) {
				if merr := unix.Mknod(name, unix.S_IFBLK|0o600, int(unix.Mkdev(loopMajor, uint32(n)))); merr != nil && merr != unix.EEXIST {
					return nil, 0, fmt.Errorf("mknod %s: %w", name, merr)
				}
			}
			continue
		}
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if err == unix.EINVAL && cfg.Info.Flags&unix.LO_FLAGS_DIRECT_IO != 0 {
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO // no direct I/O on this file system
			err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		}
		if err == nil {
			var st unix.Stat_t
			if err := unix.Fstat(int(loop.Fd()), &st); err != nil {
				loop.Close()
				return nil, 0, err
			}
			return loop, st.Rdev, nil
		}
		loop.Close()
		if err != unix.EBUSY {
			return nil, 0, fmt.Errorf("LOOP_CONFIGURE %s: %w", name, err)
		}
		lastErr = err
		if attempt >= 8 {
			time.Sleep(time.Millisecond)
		}
	}
	return nil, 0, fmt.Errorf("no free loop device: %w", lastErr)
}

// fsmountExt4 mounts the ext4 on dev detached: nosuid, nodev, noatime.
func fsmountExt4(dev string) (int, error) {
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev); err != nil {
		return -1, fmt.Errorf("fsconfig source: %w", err)
	}
	for _, opt := range strings.Split(mountData, ",") {
		k, v, ok := strings.Cut(opt, "=")
		if ok {
			err = unix.FsconfigSetString(fsfd, k, v)
		} else {
			err = unix.FsconfigSetFlag(fsfd, k)
		}
		if err != nil {
			return -1, fmt.Errorf("fsconfig %s: %w", opt, err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("fsconfig create: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOATIME)
	if err != nil {
		return -1, fmt.Errorf("fsmount: %w", err)
	}
	return mfd, nil
}
