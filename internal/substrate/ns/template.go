//go:build linux

package ns

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// TemplateBase is the default template. It runs the image Config.Images
// names for it (the Debian base image, set by internal/node) or, without
// one, the built-in host template below.
const TemplateBase = "base"

// TemplateBaseHost always runs the built-in host template: a generated
// /etc over the host's /usr (Config.UsrDir). It is base's fallback when
// no image is available, and the baseline the Debian base is benchmarked
// against.
const TemplateBaseHost = "base-host"

// baseVersion is stamped into the template; a different stamp on disk makes
// ensureTemplate rebuild it. Bump it whenever buildBase changes.
const baseVersion = "base-v3"

// templateStamp is the stamp file inside a template (visible to sandboxes,
// harmless).
const templateStamp = ".space/template-version"

// agentMount is where the agent binary appears inside a sandbox.
const agentMount = "/.space/spaced-guest"

// templateDir is the lower layer of every sandbox of template name. Both
// names of the host template share one tree (base's: sandboxes adopted
// from an earlier worker have it as their lower layer).
func (s *Substrate) templateDir(name string) string {
	if name == TemplateBaseHost {
		name = TemplateBase
	}
	return filepath.Join(s.cfg.StateDir, "templates", name)
}

// ensureTemplate builds template name once (rebuilding it if its version
// stamp differs), serialized within the process by s.tmplMu and across
// processes by an flock on StateDir/templates/.lock.
func (s *Substrate) ensureTemplate(name string) (string, error) {
	if name != TemplateBase && name != TemplateBaseHost {
		// A template of the platform whose image this host has not built
		// (Config.Images): said as such, never run on another tree.
		return "", fmt.Errorf("ns: %w: template %q is not available on this worker (no image for it: make build builds the platform's images)", errdefs.ErrUnavailable, name)
	}
	name = TemplateBase
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	dir := s.templateDir(name)
	if s.tmplReady[name] {
		return dir, nil
	}
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(parent, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("ns: lock templates: %w", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, templateStamp)); err == nil && string(b) == baseVersion {
		s.tmplReady[name] = true
		return dir, nil
	}
	tmp, err := os.MkdirTemp(parent, "."+name+"-build-")
	if err != nil {
		return "", err
	}
	if err := buildBase(tmp, s.cfg.UsrDir); err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("ns: build template %s: %w", name, err)
	}
	// Move an outdated template aside, then swap the new one in. The old
	// one is kept: sandboxes of the previous worker binary (adopted after
	// an upgrade, adopt.go) still have it as their overlay's lower layer,
	// which follows the rename but not a removal of its files. A template
	// is about a megabyte; one is left per template version.
	if _, err := os.Lstat(dir); err == nil {
		old := fmt.Sprintf("%s.old-%s", dir, randHex(8))
		if err := os.Rename(dir, old); err != nil {
			_ = os.RemoveAll(tmp)
			return "", err
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		_ = os.RemoveAll(tmp)
		return "", err
	}
	s.cfg.Logger.Info("ns: built template", "template", name, "dir", dir, "version", baseVersion)
	s.tmplReady[name] = true
	return dir, nil
}

const (
	basePasswd = "root:x:0:0:root:/root:/bin/bash\n" +
		"user:x:1000:1000::/home/user:/bin/bash\n" +
		"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
	baseGroup = "root:x:0:\ntty:x:5:\nusers:x:100:user\nuser:x:1000:\nnogroup:x:65534:\n"
	baseHosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	baseNSS   = "passwd:\tfiles\ngroup:\tfiles\nshadow:\tfiles\nhosts:\tfiles dns\n" +
		"networks:\tfiles\nprotocols:\tfiles\nservices:\tfiles\nethers:\tfiles\nrpc:\tfiles\n"
	baseOSRelease = "NAME=\"SPACE sandbox\"\nID=space\nPRETTY_NAME=\"SPACE sandbox\"\n"
	// sudo as E2B's images have it: user may run anything as root without
	// a password. In a user namespace (userns.go) root is the sandbox's
	// own root; without one no_new_privs makes sudo refuse to run.
	baseSudoers = "Defaults\tenv_reset\nDefaults\tsecure_path=\"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"\n" +
		"root\tALL=(ALL:ALL) ALL\nuser\tALL=(ALL:ALL) NOPASSWD: ALL\n"
	// The sandbox has no passwords: PAM only has to let sudo's account
	// and session steps through (authentication is skipped: NOPASSWD).
	basePAMSudo = "#%PAM-1.0\nauth\trequired\tpam_deny.so\naccount\trequired\tpam_permit.so\nsession\trequired\tpam_permit.so\n"
)

// hostEtcCopies are harmless host configuration files or trees that
// programs in /usr expect; nothing with secrets (no shadow, gshadow, ssh
// keys, sudoers, machine-id).
var hostEtcCopies = []string{
	"alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl/certs",
	"ca-certificates.conf", "profile", "profile.d", "bash.bashrc", "inputrc",
	"localtime", "timezone", "mime.types", "protocols", "services", "ethers",
	"debian_version", "login.defs",
}

// buildBase populates root as the base template.
func buildBase(root, usr string) error {
	if _, err := os.Stat(filepath.Join(usr, "bin", "sh")); err != nil {
		return fmt.Errorf("%s is not a merged-usr tree with bin/sh: %w", usr, err)
	}
	dirs := []struct {
		path string
		mode os.FileMode
		uid  int
	}{
		{"etc", 0o755, 0}, {"home", 0o755, 0}, {"home/user", 0o755, 1000},
		{"root", 0o700, 0}, {"tmp", os.ModeSticky | 0o777, 0}, {"usr", 0o755, 0},
		{"proc", 0o555, 0}, {"dev", 0o755, 0}, {"sys", 0o555, 0},
		{"run", 0o755, 0}, {"var", 0o755, 0}, {"var/tmp", os.ModeSticky | 0o777, 0},
		{"var/log", 0o755, 0}, {"var/cache", 0o755, 0}, {"var/lib", 0o755, 0},
		{"mnt", 0o755, 0}, {"opt", 0o755, 0}, {"srv", 0o755, 0},
		{".space", 0o755, 0},
	}
	for _, d := range dirs {
		p := filepath.Join(root, d.path)
		if err := os.Mkdir(p, d.mode); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err := os.Chmod(p, d.mode); err != nil { // umask-proof, keeps sticky bits
			return err
		}
		if err := os.Lchown(p, d.uid, d.uid); err != nil {
			return err
		}
	}
	if err := os.Chmod(root, 0o755); err != nil {
		return err
	}
	for _, l := range []string{"bin", "sbin", "lib", "lib64", "lib32", "libx32"} {
		if l != "bin" && l != "sbin" && l != "lib" {
			if _, err := os.Stat(filepath.Join(usr, l)); err != nil {
				continue
			}
		}
		if err := os.Symlink("usr/"+l, filepath.Join(root, l)); err != nil {
			return err
		}
	}
	files := map[string]string{
		"etc/passwd":        basePasswd,
		"etc/group":         baseGroup,
		"etc/hostname":      "sandbox\n",
		"etc/hosts":         baseHosts,
		"etc/resolv.conf":   "# no network\n",
		"etc/nsswitch.conf": baseNSS,
		"etc/os-release":    baseOSRelease,
		"etc/shells":        "/bin/sh\n/bin/bash\n/usr/bin/sh\n/usr/bin/bash\n",
		"etc/sudoers":       baseSudoers,
		"etc/pam.d/sudo":    basePAMSudo,
		templateStamp:       baseVersion,
	}
	if err := os.MkdirAll(filepath.Join(root, "etc/pam.d"), 0o755); err != nil {
		return err
	}
	for p, content := range files {
		mode := os.FileMode(0o644)
		if p == "etc/sudoers" {
			mode = 0o440 // sudo refuses a sudoers file others may read or write
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), mode); err != nil {
			return err
		}
		if err := os.Chmod(filepath.Join(root, p), mode); err != nil {
			return err
		}
	}
	// Mount points for the agent binary (a file, so the bind mount does not
	// copy anything up into the writable layer).
	if err := os.WriteFile(filepath.Join(root, strings.TrimPrefix(agentMount, "/")), nil, 0o755); err != nil {
		return err
	}
	for _, rel := range hostEtcCopies {
		src := filepath.Join("/etc", rel)
		if _, err := os.Lstat(src); err != nil {
			continue
		}
		if err := copyTree(src, filepath.Join(root, "etc", rel)); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
	}
	return nil
}

// copyTree copies regular files, directories and symlinks (as symlinks)
// from src to dst, owned by root; anything else is skipped.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		out := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
				return err
			}
			return os.Symlink(t, out)
		case d.IsDir():
			return os.MkdirAll(out, info.Mode().Perm())
		case d.Type().IsRegular():
			if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
				return err
			}
			return copyFile(p, out, info.Mode().Perm()&0o755)
		}
		return nil
	})
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
