package cli

// Template commands: build (from a Dockerfile).

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/dockerfile"
	"github.com/spacesbx/space/sdk"
)

func cmdTemplateBuild(ctx context.Context, g *globals, args []string, e *env) error {
	fs := newFlagSet("template build")
	g.register(fs)
	name := fs.String("name", "", "template name (alias[:tag]); required")
	file := fs.String("file", "", "Dockerfile (default <context>/Dockerfile)")
	ready := fs.String("ready-cmd", "", "command that succeeds once the start command serves (default: none)")
	noCache := fs.Bool("no-cache", false, "run every step, cached or not")
	buildArgs := kvFlag{}
	fs.Var(buildArgs, "build-arg", "ARG value key=value (repeatable)")
	var tags multiFlag
	fs.Var(&tags, "tag", "extra tag for the build (repeatable)")
	pos, _, _, err := parse(fs, args)
	if err != nil {
		return err
	}
	if *name == "" {
		return usagef("template build: --name is required")
	}
	if len(pos) > 1 {
		return usagef("template build: one build context at most, got %q", pos)
	}
	ctxDir := "."
	if len(pos) == 1 {
		ctxDir = pos[0]
	}
	if *file == "" {
		*file = filepath.Join(ctxDir, "Dockerfile")
	}
	f, err := os.Open(*file)
	if err != nil {
		return fmt.Errorf("template build: %w", err)
	}
	b, err := dockerfile.Parse(f, buildArgs)
	f.Close()
	if err != nil {
		return err
	}
	for _, w := range b.Warnings {
		fmt.Fprintf(e.stderr, "warning: %s\n", w)
	}
	spec := sdk.BuildSpec{Steps: b.Steps, StartCmd: b.StartCmd, ReadyCmd: *ready, Force: *noCache}
	c, err := g.client()
	if err != nil {
		return err
	}
	// FROM names a template of the platform or the team if one exists by
	// that name, an OCI image otherwise.
	if ok, err := c.TemplateExists(ctx, b.From); err != nil {
		return err
	} else if ok {
		spec.FromTemplate = b.From
	} else {
		spec.FromImage = b.From
	}
	t0 := time.Now()
	progress := func(format string, a ...any) {
		fmt.Fprintf(e.stderr, "[%6.1fs] %s\n", time.Since(t0).Seconds(), fmt.Sprintf(format, a...))
	}
	ref, err := c.RequestBuild(ctx, *name, tags)
	if err != nil {
		return err
	}
	progress("template %s, build %s: %d steps from %s", ref.TemplateID, ref.BuildID, len(spec.Steps), b.From)
	for i := range spec.Steps {
		st := &spec.Steps[i]
		if st.Type != "COPY" {
			continue
		}
		hash, up, err := uploadContext(ctx, c, ref, ctxDir, st.Args[0])
		if err != nil {
			return fmt.Errorf("template build: step %d: %w", i+1, err)
		}
		st.FilesHash = hash
		if up {
			progress("uploaded %s", st.Args[0])
		} else {
			progress("%s already uploaded", st.Args[0])
		}
	}
	if err := c.StartBuild(ctx, ref, spec); err != nil {
		return err
	}
	err = c.WaitBuild(ctx, ref, func(l e2bapi.BuildLogEntry) {
		progress("%s", l.Message)
	})
	if err != nil {
		return err
	}
	progress("built %s (template %s, build %s)", *name, ref.TemplateID, ref.BuildID)
	fmt.Fprintln(e.stdout, ref.TemplateID)
	return nil
}

// multiFlag collects a repeated string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(s string) error { *m = append(*m, s); return nil }

// uploadContext archives src (relative to the context dir, never outside
// it) as the build unpacks it and uploads it unless the platform has it.
// The hash covers names, modes, link targets and contents (not times),
// so an unchanged source is a cache hit.
func uploadContext(ctx context.Context, c *sdk.Client, ref sdk.BuildRef, ctxDir, src string) (string, bool, error) {
	root, err := filepath.Abs(ctxDir)
	if err != nil {
		return "", false, err
	}
	full := filepath.Join(root, filepath.FromSlash(src))
	if rel, err := filepath.Rel(root, full); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", false, fmt.Errorf("%s is outside the build context", src)
	}
	tmp, err := os.CreateTemp("", "space-context-*.tar")
	if err != nil {
		return "", false, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	h := sha256.New()
	tw := tar.NewWriter(tmp)
	var paths []string
	err = filepath.WalkDir(full, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		return "", false, err
	}
	sort.Strings(paths)
	for _, p := range paths {
		fi, err := os.Lstat(p)
		if err != nil {
			return "", false, err
		}
		rel, _ := filepath.Rel(root, p)
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return "", false, err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return "", false, fmt.Errorf("%s: %w", rel, err)
		}
		hdr.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		fmt.Fprintf(h, "%s\x00%o\x00%s\x00%d\x00", hdr.Name, hdr.Mode, link, hdr.Size)
		if err := tw.WriteHeader(hdr); err != nil {
			return "", false, err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return "", false, err
			}
			_, err = io.Copy(io.MultiWriter(tw, h), f)
			f.Close()
			if err != nil {
				return "", false, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return "", false, err
	}
	size, err := tmp.Seek(0, io.SeekCurrent)
	if err != nil {
		return "", false, err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return "", false, err
	}
	hash := hex.EncodeToString(h.Sum(nil))
	up, err := c.UploadFiles(ctx, ref, hash, tmp, size)
	return hash, up, err
}
