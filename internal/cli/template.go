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

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/dockerfile"
	"github.com/spacesbx/space/sdk"
)

func templateCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "template",
		Aliases: []string{"tpl"},
		Short:   "Build templates",
		RunE:    groupRun,
	}
	cmd.AddCommand(templateBuildCmd(g))
	return cmd
}

// builtTemplate is what template build prints with --json.
type builtTemplate struct {
	TemplateID string `json:"templateID"`
	BuildID    string `json:"buildID"`
	Name       string `json:"name"`
}

func templateBuildCmd(g *globals) *cobra.Command {
	var (
		name, file, ready string
		noCache, asJSON   bool
		buildArgs         = kvFlag{}
		tags              []string
	)
	cmd := &cobra.Command{
		Use:   "build --name NAME[:TAG] [flags] [CONTEXT]",
		Short: "Build a template from a Dockerfile",
		Long: `Build a template from a Dockerfile: FROM a template or an image; RUN, COPY,
ADD, ENV, WORKDIR, USER, ARG; CMD/ENTRYPOINT start it. Prints the template id;
the build's log goes to stderr.`,
		Args: func(cmd *cobra.Command, a []string) error {
			if len(a) > 1 {
				return &usageError{msg: fmt.Sprintf("template build: one build context at most, got %q", a), cmd: cmd.CommandPath()}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, a []string) error {
			if name == "" {
				return &usageError{msg: "template build: --name is required", cmd: cmd.CommandPath()}
			}
			ctxDir := "."
			if len(a) == 1 {
				ctxDir = a[0]
			}
			return buildTemplate(cmd.Context(), g, buildOptions{name: name, file: file, ready: ready, noCache: noCache,
				asJSON: asJSON, buildArgs: buildArgs, tags: tags, ctxDir: ctxDir})
		},
	}
	f := cmd.Flags()
	f.StringVar(&name, "name", "", "template name (alias[:tag]); required")
	f.StringVarP(&file, "file", "f", "", "Dockerfile (default CONTEXT/Dockerfile)")
	f.StringVar(&ready, "ready-cmd", "", "command that succeeds once the start command serves (default: none)")
	f.BoolVar(&noCache, "no-cache", false, "run every step, cached or not")
	f.Var(buildArgs, "build-arg", "ARG value key=value (repeatable)")
	f.StringArrayVar(&tags, "tag", nil, "extra tag for the build (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print {templateID, buildID, name} as JSON; no build log")
	return cmd
}

type buildOptions struct {
	name, file, ready, ctxDir string
	noCache, asJSON           bool
	buildArgs                 kvFlag
	tags                      []string
}

func buildTemplate(ctx context.Context, g *globals, o buildOptions) error {
	e := g.e
	name, file, ready, noCache, buildArgs, tags, ctxDir := &o.name, &o.file, &o.ready, &o.noCache, o.buildArgs, o.tags, o.ctxDir
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
		if !o.asJSON {
			fmt.Fprintf(e.stderr, "[%6.1fs] %s\n", time.Since(t0).Seconds(), fmt.Sprintf(format, a...))
		}
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
	if o.asJSON {
		return printJSON(e.stdout, builtTemplate{TemplateID: ref.TemplateID, BuildID: ref.BuildID, Name: *name})
	}
	_, err = fmt.Fprintln(e.stdout, ref.TemplateID)
	return err
}

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
