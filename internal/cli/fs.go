package cli

// The fs commands: ls, cat, put and get of files in a sandbox.

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/spacesbx/space/sdk"
)

func fsCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fs",
		Short: "List, read, upload and download files in a sandbox",
		RunE:  groupRun,
	}
	var user string
	cmd.PersistentFlags().StringVarP(&user, "user", "u", "", "act as this sandbox user")
	opts := func() sdk.FileOptions { return sdk.FileOptions{User: user} }
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls ID PATH",
		Short: "List a directory",
		Args:  args(2, "ID PATH"),
		RunE: func(cmd *cobra.Command, a []string) error {
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			entries, err := sbx.ListDir(cmd.Context(), a[1], opts())
			if err != nil {
				return onFile(a[0], a[1], err)
			}
			if asJSON {
				if entries == nil {
					entries = []sdk.EntryInfo{}
				}
				return printJSON(g.e.stdout, entries)
			}
			tw := tabwriter.NewWriter(g.e.stdout, 0, 4, 2, ' ', 0)
			for _, en := range entries {
				name := en.Name
				if en.Type == "dir" {
					name += "/"
				}
				if en.SymlinkTarget != "" {
					name += " -> " + en.SymlinkTarget
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", orDash(en.Permissions), en.Size, fmtTime(en.ModTime), name)
			}
			return tw.Flush()
		},
	}
	jsonFlag(ls, &asJSON)
	cat := &cobra.Command{
		Use:   "cat ID PATH",
		Short: "Print a file",
		Args:  args(2, "ID PATH"),
		RunE: func(cmd *cobra.Command, a []string) error {
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			_, err = sbx.ReadFileTo(cmd.Context(), a[1], g.e.stdout, opts())
			return onFile(a[0], a[1], err)
		},
	}
	put := &cobra.Command{
		Use:   "put ID LOCAL REMOTE",
		Short: "Upload a local file",
		Args:  args(3, "ID LOCAL REMOTE"),
		RunE: func(cmd *cobra.Command, a []string) error {
			f, err := os.Open(a[1])
			if err != nil {
				return err
			}
			defer f.Close()
			st, err := f.Stat()
			if err != nil {
				return err
			}
			if st.IsDir() {
				return usagef("fs put: %s is a directory", a[1])
			}
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			if st.Size() <= 16<<20 {
				data, err := io.ReadAll(f)
				if err != nil {
					return err
				}
				_, err = sbx.WriteFile(cmd.Context(), a[2], data, opts())
				return onFile(a[0], a[2], err)
			}
			_, err = sbx.WriteFileFrom(cmd.Context(), a[2], f, opts())
			return onFile(a[0], a[2], err)
		},
	}
	get := &cobra.Command{
		Use:   "get ID REMOTE LOCAL",
		Short: "Download a file (written in place only once complete)",
		Args:  args(3, "ID REMOTE LOCAL"),
		RunE: func(cmd *cobra.Command, a []string) error {
			sbx, err := g.open(cmd.Context(), a[0])
			if err != nil {
				return err
			}
			return getFile(cmd.Context(), sbx, a[1], a[2], opts())
		},
	}
	cmd.AddCommand(ls, cat, put, get)
	return cmd
}

// getFile downloads into a temporary file next to local and renames it into
// place, so a failed download never leaves a truncated file.
func getFile(ctx context.Context, sbx *sdk.Sandbox, remote, local string, fo sdk.FileOptions) error {
	dir, base := ".", local
	if i := strings.LastIndexByte(local, '/'); i >= 0 {
		dir, base = local[:i+1], local[i+1:]
	}
	if base == "" {
		return usagef("fs get: %q names a directory", local)
	}
	tmp, err := os.CreateTemp(dir, "."+base+".space-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := sbx.ReadFileTo(ctx, remote, tmp, fo); err != nil {
		tmp.Close()
		return onFile(sbx.ID, remote, err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), local)
}
