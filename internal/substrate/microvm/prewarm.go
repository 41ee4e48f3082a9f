//go:build linux

package microvm

import (
	"context"

	"github.com/spacesbx/space/internal/substrate"
)

// Templates' images and prewarming: which image a template boots when a
// spec names none, and the background build of the default templates.

// templateImage gives spec its template's image (Config.Images) when it
// names none.
func (s *Substrate) templateImage(spec substrate.Spec) substrate.Spec {
	if spec.Image == nil {
		if img, ok := s.cfg.Images[spec.Template]; ok {
			spec.Image = &img
		}
	}
	return spec
}

// prewarm starts building the default shape's template when
// Config.PrewarmAgent is set (a failure is logged by templateFor).
func (s *Substrate) prewarm() {
	if s.cfg.PrewarmAgent == "" || s.cfg.NoTemplates {
		return
	}
	imgID, imgPath, err := s.ensureImage(s.cfg.PrewarmAgent)
	if err != nil {
		s.cfg.Logger.Warn("microvm: prewarm: guest image", "err", err)
		return
	}
	shape := shapeOf(s.cfg.Limits)
	s.tmplWG.Add(1)
	go func() { // owned: Close waits for it
		defer s.tmplWG.Done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-s.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		if len(s.cfg.Images) == 0 {
			s.templateFor(ctx, imgID, imgPath, shape, s.cfg.PrewarmAgent, nil)
			return
		}
		for name, img := range s.cfg.Images {
			root, err := s.rootFor(&img, s.cfg.Limits)
			if err != nil {
				s.cfg.Logger.Warn("microvm: prewarm: image", "template", name, "err", err)
				continue
			}
			s.templateFor(ctx, imgID, imgPath, shape, s.cfg.PrewarmAgent, root)
		}
	}()
}
