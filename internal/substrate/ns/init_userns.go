//go:build linux

package ns

// The init of a sandbox in a user namespace (userns.go): its ids, and its
// root file system built from the descriptors the worker sent.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// becomeNamespaceRoot makes every id of the init the namespace's root
// (the clone left the real and saved ids at host ids the namespace does
// not map) and drops the host's supplementary groups. Changing the
// effective gid cleared the parent-death signal; it is set again.
func becomeNamespaceRoot() error {
	if err := unix.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := unix.Setresgid(0, 0, 0); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := unix.Setresuid(0, 0, 0); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
		return fmt.Errorf("parent-death signal: %w", err)
	}
	return nil
}

// setupUserNSRootfs is setupRootfs for an init in a user namespace: the
// layers come as descriptors (fds, see initConfig.UserNS), are attached
// under a private tmpfs (staging, in this mount namespace only) and the
// overlay is mounted there with userxattr. It returns the agent's
// listening socket.
func setupUserNSRootfs(c *initConfig, fds []int) (int, error) {
	if err := mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return -1, err
	}
	staging := ""
	for _, d := range []string{"/tmp", "/mnt", "/run"} {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			staging = d
			break
		}
	}
	if staging == "" {
		return -1, errors.New("no directory to stage the root file system under (/tmp, /mnt, /run)")
	}
	if err := mount("tmpfs", staging, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700,size=64k"); err != nil {
		return -1, err
	}
	fi := c.nsFDs()
	layer, dir, r := filepath.Join(staging, "y"), filepath.Join(staging, "d"), filepath.Join(staging, "r")
	lowers := make([]string, c.NLower)
	for i := range lowers {
		lowers[i] = filepath.Join(staging, strconv.Itoa(i))
	}
	for _, d := range append([]string{layer, dir, r}, lowers...) {
		if err := os.Mkdir(d, 0o700); err != nil {
			return -1, err
		}
	}
	attach := func(fd int, dst string) error {
		if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("attach mount on %s: %w", dst, err)
		}
		return nil
	}
	for i, l := range lowers {
		if err := attach(fds[i], l); err != nil {
			return -1, err
		}
	}
	if err := attach(fds[fi.layer], layer); err != nil {
		return -1, err
	}
	if err := attach(fds[fi.dir], dir); err != nil {
		return -1, err
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/%s,workdir=%s/%s,userxattr", strings.Join(lowers, ":"), layer, "upper", layer, "work")
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if c.Suid {
		flags = unix.MS_NODEV
	}
	if err := mount("overlay", r, "overlay", flags, opts); err != nil {
		return -1, err
	}
	if err := addHostsEntry(r, c.Hostname); err != nil {
		return -1, err
	}
	if c.HostUsr {
		if err := attach(fds[fi.usr], filepath.Join(r, "usr")); err != nil {
			return -1, err
		}
	}
	if err := ensureMountPoints(r); err != nil {
		return -1, err
	}
	if err := setupProc(r); err != nil {
		return -1, err
	}
	if err := setupDev(r, c.MaxPTYs); err != nil {
		return -1, err
	}
	if err := attach(fds[fi.agent], filepath.Join(r, agentMount)); err != nil {
		return -1, err
	}
	if err := mountVolumes(r, c.Volumes, c.volFDs); err != nil {
		return -1, err
	}
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
	// The socket is made here, in the sandbox's network namespace (where
	// spaced-host looks for the listener) and by the agent's process (a
	// client's SO_PEERCRED is the listener's); it is bound through the
	// idmapped activation directory, where the init owns what host root
	// owns, so it lands at <Spec.Dir>/guest.sock on the host.
	lfd, err := listenUnix(filepath.Join(dir, filepath.Base(c.Socket)))
	if err != nil {
		return -1, err
	}
	if err := pivot(r); err != nil {
		return -1, err
	}
	return lfd, nil
}
