//go:build linux

// Package loopdev attaches image files to loop devices and mounts the ext4
// on them detached: the few calls the ns substrate's layer disks and the
// team volumes share (both sit on sparse ext4 images).
package loopdev

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Major is the block major of loop devices.
const Major = 7

// Attach binds the image open at fd to a free loop device with autoclear
// (it detaches itself once the last mount of its file system is gone) and
// direct I/O where the backing file system allows it, and returns the
// device open read-write with its number.
func Attach(fd int, blockSize uint32) (*os.File, uint64, error) {
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
		loop, err := Open("loop"+strconv.Itoa(n), os.O_RDWR)
		if errors.Is(err, unix.ENXIO) || errors.Is(err, os.ErrNotExist) {
			lastErr = err // removed meanwhile (LOOP_CTL_REMOVE)
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if err == unix.EINVAL && cfg.Info.Flags&unix.LO_FLAGS_DIRECT_IO != 0 {
			// The backing file system cannot do direct I/O here.
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO
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
			return nil, 0, fmt.Errorf("LOOP_CONFIGURE %s: %w", loop.Name(), err)
		}
		lastErr = err
		if attempt >= 8 {
			time.Sleep(time.Millisecond)
		}
	}
	return nil, 0, fmt.Errorf("no free loop device: %w", lastErr)
}

// Open opens /dev/<name> (a loop device, e.g. "loop3") with flag, making
// the node from sysfs when /dev lacks it (a /dev that is not a devtmpfs).
func Open(name string, flag int) (*os.File, error) {
	p := "/dev/" + name
	f, err := os.OpenFile(p, flag|unix.O_CLOEXEC, 0)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	b, rerr := os.ReadFile("/sys/block/" + name + "/dev")
	if rerr != nil {
		return nil, err
	}
	maj, mnr, ok := strings.Cut(strings.TrimSpace(string(b)), ":")
	ma, _ := strconv.ParseUint(maj, 10, 32)
	mi, _ := strconv.ParseUint(mnr, 10, 32)
	if !ok || ma != Major {
		return nil, err
	}
	if merr := unix.Mknod(p, unix.S_IFBLK|0o600, int(unix.Mkdev(uint32(ma), uint32(mi)))); merr != nil && merr != unix.EEXIST {
		return nil, fmt.Errorf("mknod %s: %w", p, merr)
	}
	return os.OpenFile(p, flag|unix.O_CLOEXEC, 0)
}

// MountExt4 mounts the ext4 on dev detached (fsmount: in no mount
// namespace) with data's comma-separated options, nosuid, nodev and
// noatime, and returns the mount's descriptor.
func MountExt4(dev, data string) (int, error) {
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev); err != nil {
		return -1, fmt.Errorf("fsconfig source: %w", err)
	}
	for _, opt := range strings.Split(data, ",") {
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
