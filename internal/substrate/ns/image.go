package ns

// Images (substrate.Spec.Image, Config.Images). A sandbox of an image has
// overlay(lowerdir = the image's layers, top first; upperdir = its
// writable layer) as its root and nothing of the host's: no /usr bind.
// The layers are whole trees of their own owners and modes (set-uid
// sudo), so in a user namespace they are mounted without nosuid, where
// set-uid root makes a process root of the sandbox's namespace only;
// without a user namespace that root would be the host's (the init runs
// with host root's uid), so there they stay nosuid and sudo refuses.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// maxImageLayers bounds an image's stack: each layer is a descriptor sent
// to a user-namespaced init (SCM_RIGHTS carries at most 253) and an
// entry of overlay's lowerdir option (at most a page).
const maxImageLayers = 128

// guestConfigVar is the agent's configuration in its environment
// (cmd/spaced-guest).
const guestConfigVar = "SPACE_GUEST_CONFIG="

// validateImage checks the stack of img: 1..maxImageLayers absolute,
// clean paths of directories, none with characters overlay's options
// cannot carry.
func validateImage(img *substrate.Image) error {
	if len(img.Layers) == 0 {
		return errors.New("image has no layers")
	}
	if len(img.Layers) > maxImageLayers {
		return fmt.Errorf("image has %d layers, at most %d", len(img.Layers), maxImageLayers)
	}
	for _, l := range img.Layers {
		if !filepath.IsAbs(l) || filepath.Clean(l) != l || strings.ContainsAny(l, ",:\\\n\x00") {
			return fmt.Errorf("layer %q: not a clean absolute path overlayfs accepts", l)
		}
	}
	for _, e := range img.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsRune(e, 0) {
			return fmt.Errorf("env %q: not KEY=VALUE", e)
		}
	}
	if img.WorkingDir != "" && !filepath.IsAbs(img.WorkingDir) {
		return fmt.Errorf("working dir %q: not absolute", img.WorkingDir)
	}
	return nil
}

// checkLayers refuses a layer that is not a directory (a missing layer
// would otherwise surface as the init's mount error) or whose parent
// others could change: layers hold set-uid files and are trusted as the
// platform published them, so their parents must be root's alone.
func checkLayers(img *substrate.Image) error {
	for _, l := range img.Layers {
		fi, err := os.Stat(l)
		if err != nil {
			return fmt.Errorf("layer: %w", err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("layer %s: not a directory", l)
		}
		pi, err := os.Stat(filepath.Dir(l))
		if err != nil {
			return fmt.Errorf("layer: %w", err)
		}
		st, ok := pi.Sys().(*syscall.Stat_t)
		if !ok || st.Uid != 0 || pi.Mode().Perm()&0o022 != 0 {
			return fmt.Errorf("layer %s: its parent must be root's and writable by root only (mode %v)", l, pi.Mode())
		}
	}
	return nil
}

// imageFor is the image spec runs: its own, or its template's from
// Config.Images; nil for the host template.
func (s *Substrate) imageFor(spec *substrate.Spec) (*substrate.Image, error) {
	img := spec.Image
	if img == nil {
		if spec.Template == TemplateBaseHost {
			return nil, nil
		}
		i, ok := s.cfg.Images[spec.Template]
		if !ok {
			return nil, nil
		}
		img = &i
	}
	if err := validateImage(img); err != nil {
		return nil, fmt.Errorf("ns: %w: %w", errdefs.ErrInvalid, err)
	}
	if err := checkLayers(img); err != nil {
		return nil, fmt.Errorf("ns: %w: %w", errdefs.ErrInvalid, err)
	}
	return img, nil
}

// topFirst is the stack in overlay's lowerdir order (Image.Layers is
// bottom first).
func topFirst(layers []string) []string {
	l := slices.Clone(layers)
	slices.Reverse(l)
	return l
}

// withImageDefaults returns the agent's environment with img's process
// defaults merged into its configuration (SPACE_GUEST_CONFIG): Env under
// the configuration's own variables (the sandbox's envVars win),
// User as the default user, WorkingDir as the default working directory.
// An environment without a configuration is returned as it is.
func withImageDefaults(env []string, img *substrate.Image) ([]string, error) {
	if img == nil || (len(img.Env) == 0 && img.User == "" && img.WorkingDir == "") {
		return env, nil
	}
	out := slices.Clone(env)
	for i, e := range out {
		raw, ok := strings.CutPrefix(e, guestConfigVar)
		if !ok {
			continue
		}
		var cfg map[string]json.RawMessage
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return nil, fmt.Errorf("ns: agent configuration: %w", err)
		}
		if cfg == nil {
			return nil, errors.New("ns: agent configuration: not an object")
		}
		vars := map[string]string{}
		if b, ok := cfg["env"]; ok && string(b) != "null" {
			if err := json.Unmarshal(b, &vars); err != nil {
				return nil, fmt.Errorf("ns: agent configuration env: %w", err)
			}
		}
		for _, kv := range img.Env {
			k, v, _ := strings.Cut(kv, "=")
			if _, set := vars[k]; !set {
				vars[k] = v
			}
		}
		if len(vars) > 0 {
			cfg["env"], _ = json.Marshal(vars)
		}
		// "name" or "name:group": the agent takes a user name.
		if u, _, _ := strings.Cut(img.User, ":"); u != "" {
			cfg["default_user"], _ = json.Marshal(u)
		}
		if img.WorkingDir != "" {
			cfg["default_cwd"], _ = json.Marshal(img.WorkingDir)
		}
		b, err := json.Marshal(cfg)
		if err != nil {
			return nil, fmt.Errorf("ns: agent configuration: %w", err)
		}
		out[i] = guestConfigVar + string(b)
	}
	return out, nil
}
