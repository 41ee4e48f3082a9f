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

// handleVolumeList is GET /volumecontent/{id}/dir?path&depth.
func (s *Server) handleVolumeList(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	depth := 1
	if v := r.URL.Query().Get("depth"); v != "" {
		if depth, err = strconv.Atoi(v); err != nil || depth < 1 || depth > 64 {
			s.writeError(w, r, fmt.Errorf("%w: depth must be 1..64", errdefs.ErrInvalid))
			return
		}
	}
	out, err := d.List(p, depth)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// handleVolumeMkdir is POST /volumecontent/{id}/dir?path&uid&gid&mode&force.
func (s *Server) handleVolumeMkdir(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	a, err := queryAttrs(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	e, err := d.Mkdir(p, a, queryBool(r, "force"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, e)
}

// handleVolumeStat is GET /volumecontent/{id}/path?path.
func (s *Server) handleVolumeStat(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	e, err := d.Stat(p)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}

// handleVolumeSetAttrs is PATCH /volumecontent/{id}/path?path with
// {uid, gid, mode}.
func (s *Server) handleVolumeSetAttrs(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	var body struct {
		UID  *uint32 `json:"uid"`
		GID  *uint32 `json:"gid"`
		Mode *uint32 `json:"mode"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&body); err != nil {
		s.writeError(w, r, fmt.Errorf("%w: body must be {uid, gid, mode}", errdefs.ErrInvalid))
		return
	}
	e, err := d.SetAttrs(p, volume.Attrs{UID: body.UID, GID: body.GID, Mode: body.Mode})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}

// handleVolumeRemove is DELETE /volumecontent/{id}/path?path.
func (s *Server) handleVolumeRemove(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	if err := d.Remove(p); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// handleVolumeRead is GET /volumecontent/{id}/file?path.
func (s *Server) handleVolumeRead(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	f, err := d.Open(p)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.WriteHeader(http.StatusOK)
	_, _ = io.Copy(w, f)
}

// handleVolumeWrite is PUT /volumecontent/{id}/file?path&uid&gid&mode
// with the file's bytes.
func (s *Server) handleVolumeWrite(w http.ResponseWriter, r *http.Request) {
	d, p, err := s.volumeDir(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer d.Close()
	a, err := queryAttrs(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	e, err := d.WriteFile(p, r.Body, a, maxVolumeUpload)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}
