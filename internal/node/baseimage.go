package node

import (
	"context"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/ns"
)

// baseImages gives the ns `base` template the Debian base image as
// cfg.BaseImage says; none (the host template) when it is off or the
// image is unavailable, which is logged with the reason.
func baseImages(cfg Config) map[string]substrate.Image {
	if cfg.BaseImage == BaseImageOff {
		cfg.Logger.Info("base template: the host's /usr (base image off)")
		return nil
	}
	bcfg := baseimage.Config{CacheDir: cfg.BaseImageCache}
	var b baseimage.Base
	var err error
	if cfg.BaseImage == BaseImageBuild {
		b, err = baseimage.Ensure(context.Background(), bcfg, cfg.Logger)
	} else {
		b, err = baseimage.Lookup(bcfg)
	}
	if err != nil {
		cfg.Logger.Warn("base template: the Debian base image is unavailable; base sandboxes run on the host's /usr (as "+ns.TemplateBaseHost+")",
			"reason", err.Error())
		return nil
	}
	cfg.Logger.Info("base template: the Debian base image", "id", b.ID, "dir", b.Dir)
	images := map[string]substrate.Image{ns.TemplateBase: {ID: b.ID, Layers: []string{b.Dir}, Env: b.Env}}
	icfg := baseimage.InterpConfig{Base: bcfg}
	var st baseimage.Stack
	if cfg.BaseImage == BaseImageBuild {
		st, err = baseimage.EnsureInterp(context.Background(), icfg, cfg.Logger)
	} else {
		st, err = baseimage.LookupInterp(icfg)
	}
	if err != nil {
		cfg.Logger.Warn("code interpreter template: its image is unavailable; "+TemplateCodeInterpreter+" creates on this host fail", "reason", err.Error())
		return images
	}
	cfg.Logger.Info("code interpreter template: the code interpreter image", "id", st.ID)
	images[TemplateCodeInterpreter] = substrate.Image{ID: st.ID, Layers: st.Layers, Env: st.Env}
	return images
}

// The code interpreter templates (the @e2b/code-interpreter SDK's
// default): the code interpreter image (baseimage.EnsureInterp) on ns, and
// the same image in a microVM.
const (
	TemplateCodeInterpreter   = "code-interpreter-v1"
	VMTemplateCodeInterpreter = "code-interpreter-v1-vm"
)

// VMTemplateBase is the microvm template that boots the Debian base
// image when it is available (busybox otherwise).
const VMTemplateBase = "base-vm"

// vmImages gives the microvm substrate the Debian base for base-vm and
// the code interpreter image for its VM template: the same images serve
// both substrates.
func vmImages(images map[string]substrate.Image) map[string]substrate.Image {
	img, ok := images[ns.TemplateBase]
	if !ok {
		return nil
	}
	out := map[string]substrate.Image{VMTemplateBase: img}
	if ci, ok := images[TemplateCodeInterpreter]; ok {
		out[VMTemplateCodeInterpreter] = ci
	}
	return out
}
