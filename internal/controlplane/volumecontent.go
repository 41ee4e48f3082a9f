package controlplane

// The volume content API (E2B's VolumeApiClient: E2B_VOLUME_API_URL,
// default the API's own URL): file operations on a volume without a
// sandbox, authorized by the volume's token (Authorization: Bearer), not
// by a team's key. The control plane reaches the volume's files through
// Deps.Volumes, a volume manager on the volume root (space up: the
// workers' root, on the same host; elsewhere the operator's shared
// storage mounted on the API host too); without one it answers 503.

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/volume"
)

// maxVolumeUpload bounds one file written through the content API (the
// volume's quota bounds it too).
const maxVolumeUpload = 4 << 30

// VolumeFiles opens a volume's files (volume.Manager).
type VolumeFiles interface {
	OpenDir(ctx context.Context, id string) (*volume.Dir, error)
}

// volumeDir authorizes r for the volume named in its path and opens it;
// the caller closes the result.
func (s *Server) volumeDir(r *http.Request) (*volume.Dir, string, error) {
	id := r.PathValue("id")
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return nil, "", fmt.Errorf("%w: the volume's token is required (Authorization: Bearer)", errdefs.ErrUnauthenticated)
	}
	if volume.ValidateID(id) != nil {
		return nil, "", fmt.Errorf("%w: volume %s", errdefs.ErrNotFound, truncate(id, 64))
	}
	rec, err := s.st.GetVolumeByID(r.Context(), id)
	if errors.Is(err, errdefs.ErrNotFound) || (err == nil && rec.Deleting) {
		return nil, "", fmt.Errorf("%w: volume %s", errdefs.ErrNotFound, id)
	}
	if err != nil {
		return nil, "", err
	}
	if subtle.ConstantTimeCompare([]byte(tok), []byte(rec.Token)) != 1 {
		return nil, "", fmt.Errorf("%w: not this volume's token", errdefs.ErrUnauthenticated)
	}
	if s.volumes == nil {
		return nil, "", errdefs.Message(errdefs.ErrUnavailable, "the volume content API is not served by this control plane (no volume root)")
	}
	p, err := volume.Clean(r.URL.Query().Get("path"))
	if err != nil {
		return nil, "", err
	}
	d, err := s.volumes.OpenDir(r.Context(), id)
	if err != nil {
		return nil, "", err
	}
	return d, p, nil
}

// queryAttrs reads uid, gid and mode from the query (numbers; mode may be
// written in octal with a leading 0).
func queryAttrs(r *http.Request) (volume.Attrs, error) {
	var a volume.Attrs
	q := r.URL.Query()
	for _, f := range []struct {
		name string
		dst  **uint32
	}{{"uid", &a.UID}, {"gid", &a.GID}, {"mode", &a.Mode}} {
		v := q.Get(f.name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseUint(v, 0, 32)
		if err != nil {
			return a, fmt.Errorf("%w: %s must be a number", errdefs.ErrInvalid, f.name)
		}
		u := uint32(n)
		*f.dst = &u
	}
	return a, nil
}

func queryBool(r *http.Request, name string) bool {
	b, _ := strconv.ParseBool(r.URL.Query().Get(name))
	return b
}

// volumeHandler serves one volume content call: fn gets the volume's
// directory (closed after it) and the request's path in it; an error fn
// returns, before it wrote anything, is the answer.
func (s *Server) volumeHandler(fn func(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		d, p, err := s.volumeDir(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		defer d.Close()
		if err := fn(w, r, d, p); err != nil {
			s.writeError(w, r, err)
		}
	}
}

// volumeList is GET /volumecontent/{id}/dir?path&depth.
func volumeList(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	depth := 1
	if v := r.URL.Query().Get("depth"); v != "" {
		var err error
		if depth, err = strconv.Atoi(v); err != nil || depth < 1 || depth > 64 {
			return fmt.Errorf("%w: depth must be 1..64", errdefs.ErrInvalid)
		}
	}
	out, err := d.List(p, depth)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// volumeMkdir is POST /volumecontent/{id}/dir?path&uid&gid&mode&force.
func volumeMkdir(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	a, err := queryAttrs(r)
	if err != nil {
		return err
	}
	e, err := d.Mkdir(p, a, queryBool(r, "force"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, e)
	return nil
}

// volumeStat is GET /volumecontent/{id}/path?path.
func volumeStat(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	e, err := d.Stat(p)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, e)
	return nil
}

// volumeSetAttrs is PATCH /volumecontent/{id}/path?path with
// {uid, gid, mode}.
func volumeSetAttrs(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	var body struct {
		UID  *uint32 `json:"uid"`
		GID  *uint32 `json:"gid"`
		Mode *uint32 `json:"mode"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&body); err != nil {
		return fmt.Errorf("%w: body must be {uid, gid, mode}", errdefs.ErrInvalid)
	}
	e, err := d.SetAttrs(p, volume.Attrs{UID: body.UID, GID: body.GID, Mode: body.Mode})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, e)
	return nil
}

// volumeRemove is DELETE /volumecontent/{id}/path?path.
func volumeRemove(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	if err := d.Remove(p); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// volumeRead is GET /volumecontent/{id}/file?path.
func volumeRead(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	f, err := d.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.WriteHeader(http.StatusOK)
	_, _ = io.Copy(w, f)
	return nil
}

// volumeWrite is PUT /volumecontent/{id}/file?path&uid&gid&mode with the
// file's bytes.
func volumeWrite(w http.ResponseWriter, r *http.Request, d *volume.Dir, p string) error {
	a, err := queryAttrs(r)
	if err != nil {
		return err
	}
	e, err := d.WriteFile(p, r.Body, a, maxVolumeUpload)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, e)
	return nil
}
