;;; m31r.el --- M31R offline completion for eglot, lsp-mode  -*- lexical-binding: t; -*-

;; Version: 0.1.0
;; Package-Requires: ((emacs "27.1"))
;; Keywords: languages, tools, convenience
;; SPDX-License-Identifier: MIT OR Apache-2.0

;;; Commentary:

;; M31R serves code completion from a small transformer running locally: the
;; `m31rd' daemon owns the model and `m31r lsp' is a language server (LSP over
;; stdio) in front of it.  This file connects that server to Emacs:
;;
;; * lsp-mode: `m31r' is registered as an add-on client (`:add-on? t'), so it
;;   runs beside rust-analyzer.  Its completions join the normal
;;   completion-at-point candidates; lsp-mode >= 9.0.1 also shows LSP 3.18
;;   inline completions (ghost text) through `lsp-inline-completion-mode'.
;;   Nothing to do but load this file before lsp starts.
;;
;; * eglot: call `m31r-eglot-setup'.  Eglot runs one server per buffer, so in
;;   `m31r-major-modes' buffers M31R then *replaces* rust-analyzer under eglot
;;   (use lsp-mode, or an LSP multiplexer, to have both).
;;
;; Settings are the `m31r-*' customization variables; they are sent as
;; `initializationOptions' and as `workspace/didChangeConfiguration'
;; (settings.m31r).  `m31r-toggle' turns completions off and on.

;;; Code:

(require 'cl-lib)
(require 'eieio)
(require 'subr-x)

(defgroup m31r nil
  "Offline code completion with M31R."
  :group 'tools
  :prefix "m31r-")

(defcustom m31r-executable "m31r"
  "The m31r command; Emacs runs \"<it> lsp [--socket SOCKET]\"."
  :type 'string)

(defcustom m31r-socket ""
  "Path of the m31rd daemon's socket; empty means the daemon's default.
A leading ~ is the home directory."
  :type 'string)

(defcustom m31r-major-modes '(rust-mode rust-ts-mode rustic-mode)
  "Major modes in which M31R completes.
The symbol t means every `prog-mode' (and `text-mode') buffer under
lsp-mode; for eglot it must be a list."
  :type '(choice (const :tag "All programming modes" t)
                 (repeat symbol)))

(defcustom m31r-enable t
  "Whether the server produces completions (settings.m31r.enable)."
  :type 'boolean)

(defcustom m31r-debounce-ms 75
  "Milliseconds to wait after the last keystroke before generating."
  :type 'integer)

(defcustom m31r-debounce-mode "adaptive"
  "How the debounce delay is chosen."
  :type '(choice (const "adaptive") (const "fixed")))

(defcustom m31r-multiline "auto"
  "Whether suggestions may span several lines."
  :type '(choice (const "auto") (const "always") (const "never")))

(defcustom m31r-deadline-ms 800
  "Generation budget in milliseconds.
A hard limit on a completion's time in the daemon, queueing and prefill
included: once spent, the suggestion ends with what was written so far."
  :type 'integer)

(defcustom m31r-max-tokens 64
  "Maximum number of tokens generated for one suggestion."
  :type 'integer)

(defcustom m31r-beams nil
  "Beam search width (1-8) of a single-line suggestion; nil: the daemon's --beams.
The search's runners-up are further inline completions to cycle through."
  :type '(choice (const :tag "The daemon's --beams" nil)
                 (integer :tag "Width (1-8)")))

(defcustom m31r-project-context nil
  "Non-nil: send snippets of the crate's other files with each request."
  :type 'boolean)

(defcustom m31r-min-probability 0.05
  "Hide a suggestion whose first line the model gives less than this probability.
Of a multi-line suggestion, show only the lines that together keep it.
0 shows every suggestion whole."
  :type 'number)

(defcustom m31r-inline-idle-delay 0.2
  "Idle seconds before lsp-mode asks for an inline completion in M31R buffers.
Only used with lsp-mode >= 9.0.1 (`lsp-inline-completion-mode')."
  :type 'number)

(defvar m31r-status nil
  "Last `m31r/status' from the server, a plist (:state :model :lastLatencyMs).")

(defvar m31r-status-hook nil
  "Hook run after `m31r-status' changed.")

;;;; Settings

(defun m31r--bool (value)
  "VALUE as a JSON boolean for both eglot and lsp-mode."
  (if value t :json-false))

(defun m31r--socket ()
  "`m31r-socket' with a leading ~ expanded (the server would take it literally).
Empty (or nil) stays \"\": the default socket."
  (let ((socket (or m31r-socket "")))
    (if (string-prefix-p "~" socket) (expand-file-name socket) socket)))

(defun m31r-settings ()
  "The settings object sent to the server (a plist with camelCase keys)."
  (list :enable (m31r--bool m31r-enable)
        :debounceMs m31r-debounce-ms
        :debounceMode m31r-debounce-mode
        :multiline m31r-multiline
        :deadlineMs m31r-deadline-ms
        :maxTokens m31r-max-tokens
        :beams m31r-beams
        :projectContext (m31r--bool m31r-project-context)
        :minProbability m31r-min-probability
        :socket (m31r--socket)))

(defun m31r-command ()
  "The server command line, a list of strings."
  (let ((socket (m31r--socket)))
    (append (list m31r-executable "lsp")
            (unless (string-empty-p socket)
              (list "--socket" socket)))))

(defun m31r--wanted-mode-p (mode)
  "Non-nil when M31R should complete in major MODE."
  (if (eq m31r-major-modes t)
      (provided-mode-derived-p mode 'prog-mode 'text-mode)
    (memq mode m31r-major-modes)))

;;;; Status

(defun m31r--set-status (state model latency)
  "Record a `m31r/status' notification (STATE, MODEL, LATENCY)."
  (setq m31r-status (list :state state :model model :lastLatencyMs latency))
  (run-hooks 'm31r-status-hook)
  (force-mode-line-update t))

(defun m31r-mode-line ()
  "Short status text, e.g. for `global-mode-string'.
Empty while no M31R server runs: `m31r-status' is the last status of a
server that may have exited since."
  (cond ((not m31r-enable) "M31R off")
        ((or (null m31r-status) (not (m31r--running-p))) "")
        (t (let ((state (plist-get m31r-status :state))
                 (latency (plist-get m31r-status :lastLatencyMs)))
             (pcase state
               ("ready" (if (numberp latency)
                            (format "M31R %dms" (round latency))
                          "M31R"))
               ("starting" "M31R starting")
               (_ "M31R unavailable"))))))

;;;; Pushing settings to running servers

(declare-function eglot--servers-by-project "ext:eglot")
(defvar eglot--servers-by-project)
(declare-function jsonrpc-notify "ext:jsonrpc")
(declare-function lsp-notify "ext:lsp-mode")
(declare-function lsp-workspaces "ext:lsp-mode")
(declare-function lsp--workspace-client "ext:lsp-mode")
(declare-function lsp--client-server-id "ext:lsp-mode")
(declare-function lsp--session-workspaces "ext:lsp-mode")
(declare-function lsp-session "ext:lsp-mode")
(declare-function lsp-configuration-section "ext:lsp-mode")
(declare-function lsp--set-configuration "ext:lsp-mode")
(declare-function lsp-stdio-connection "ext:lsp-mode")
(declare-function make-lsp-client "ext:lsp-mode")
(declare-function lsp-register-client "ext:lsp-mode")
(declare-function lsp-register-custom-settings "ext:lsp-mode")
(declare-function lsp-inline-completion-mode "ext:lsp-inline-completion")
(defvar lsp-inline-completion-idle-delay)

(defvar lsp--cur-workspace)
(defmacro m31r--with-lsp-workspace (workspace &rest body)
  "Run BODY with lsp-mode's current WORKSPACE bound (as `with-lsp-workspace').
Defined here so that this file compiles without lsp-mode."
  (declare (indent 1))
  `(let ((lsp--cur-workspace ,workspace)) ,@body))

(defun m31r--eglot-servers ()
  "Running eglot servers that are M31R's."
  (when (boundp 'eglot--servers-by-project)
    (let (servers)
      (maphash (lambda (_project list)
                 (dolist (s list)
                   (when (object-of-class-p s 'm31r-eglot-server)
                     (push s servers))))
               eglot--servers-by-project)
      servers)))

(defun m31r--lsp-workspaces ()
  "Running lsp-mode workspaces of the `m31r' client."
  (when (fboundp 'lsp-session)
    (cl-remove-if-not
     (lambda (ws) (eq (lsp--client-server-id (lsp--workspace-client ws)) 'm31r))
     (lsp--session-workspaces (lsp-session)))))

(defvar lsp--session)

(defun m31r--running-p ()
  "Non-nil while an M31R server runs under eglot or lsp-mode."
  (or (m31r--eglot-servers)
      ;; Only a session lsp-mode has loaded: `lsp-session' would read the session file.
      (and (bound-and-true-p lsp--session) (m31r--lsp-workspaces))))

(defun m31r-push-settings ()
  "Send the current settings to every running M31R server."
  (interactive)
  (let ((params (list :settings (list :m31r (m31r-settings)))))
    (dolist (server (m31r--eglot-servers))
      (jsonrpc-notify server :workspace/didChangeConfiguration params))
    (dolist (ws (m31r--lsp-workspaces))
      (m31r--with-lsp-workspace ws
        (lsp--set-configuration (lsp-configuration-section "m31r"))))))

;;;###autoload
(defun m31r-toggle (&optional arg)
  "Toggle M31R completions; with ARG, enable if ARG is positive."
  (interactive "P")
  (setq m31r-enable (if arg (> (prefix-numeric-value arg) 0) (not m31r-enable)))
  (m31r-push-settings)
  (force-mode-line-update t)
  (message "M31R completions %s" (if m31r-enable "enabled" "disabled")))

;;;; eglot

;; Defined by the `defclass' below, which only runs once eglot is loaded.
(declare-function m31r-eglot-server--eieio-childp "m31r" (obj))

(with-eval-after-load 'eglot
  (defclass m31r-eglot-server (eglot-lsp-server) ()
    :documentation "The M31R language server (`m31r lsp').")

  (cl-defmethod eglot-handle-notification
    ((_server m31r-eglot-server) (_method (eql m31r/status))
     &key state model lastLatencyMs &allow-other-keys)
    "Record the server's status notification."
    (m31r--set-status state
                      (and (stringp model) model)
                      (and (numberp lastLatencyMs) lastLatencyMs)))

  (cl-defmethod eglot-handle-request
    ((_server m31r-eglot-server) (_method (eql workspace/configuration))
     &key items)
    "Answer the server's configuration pull from the `m31r-*' variables."
    (apply #'vector
           (mapcar (lambda (item)
                     (let ((section (plist-get item :section)))
                       (cond ((equal section "m31r") (m31r-settings))
                             ((and (stringp section)
                                   (string-prefix-p "m31r." section))
                              (plist-get
                               (m31r-settings)
                               (intern (concat ":" (substring section 5)))))
                             (t nil))))
                   items))))

(defvar eglot-server-programs)

(defun m31r--eglot-contact (&optional interactive &rest _)
  "Eglot contact: (CLASS PROGRAM ARGS... :initializationOptions FN).
INTERACTIVE is non-nil under \\[eglot]."
  (let ((command (m31r-command)))
    ;; Eglot itself reports a missing absolute path only as "Process EGLOT (...) not running".  Not checked: on a
    ;; remote (TRAMP) buffer, where the program runs remotely, and under C-u M-x eglot, which lets one edit the command.
    (unless (or (and interactive current-prefix-arg)
                (file-remote-p default-directory)
                (executable-find (car command)))
      (user-error "M31R: cannot find the program %S: put m31r on PATH or set `m31r-executable'"
                  (car command)))
    (append (list 'm31r-eglot-server)
            command
            (list :initializationOptions (lambda (_server) (m31r-settings))))))

(defconst m31r--rust-modes '(rust-mode rust-ts-mode rustic-mode)
  "Major modes whose buffers are Rust: languageId \"rust\" under eglot.")

(defun m31r--eglot-modes ()
  "`m31r-major-modes' as the major-mode list of an `eglot-server-programs' entry.
Eglot before 1.15 (Emacs 29's too) derives the languageId from the mode's
name, \"rust-ts\" or \"rustic\", which the server does not know as Rust
\(completion documentation's code fence, a document without a suffix): the
Rust modes are (MODE :language-id \"rust\"), a form eglot accepts from 1.9 on."
  (mapcar (lambda (mode)
            (if (memq mode m31r--rust-modes) (list mode :language-id "rust") mode))
          m31r-major-modes))

;;;###autoload
(defun m31r-eglot-setup ()
  "Make eglot use M31R in `m31r-major-modes' buffers.
Eglot runs one server per buffer: there M31R takes rust-analyzer's place."
  (interactive)
  (require 'eglot)
  (unless (listp m31r-major-modes)
    (user-error "m31r-major-modes must be a list of major modes for eglot"))
  (setq eglot-server-programs
        (cl-remove-if (lambda (entry) (eq (cdr entry) #'m31r--eglot-contact))
                      eglot-server-programs))
  (add-to-list 'eglot-server-programs
               (cons (m31r--eglot-modes) #'m31r--eglot-contact)))

;;;; lsp-mode

(defun m31r--get (object key)
  "KEY (a string) of a JSON OBJECT parsed by lsp-mode (hash table or plist)."
  (if (hash-table-p object)
      (gethash key object)
    (plist-get object (intern (concat ":" key)))))

(defun m31r--lsp-configure ()
  "Turn on lsp-mode's inline completion in buffers served by M31R."
  (when (and (fboundp 'lsp-inline-completion-mode)
             (m31r--lsp-workspaces)
             (m31r--wanted-mode-p major-mode))
    (setq-local lsp-inline-completion-idle-delay m31r-inline-idle-delay)
    (lsp-inline-completion-mode 1)))

(with-eval-after-load 'lsp-mode
  (lsp-register-custom-settings
   '(("m31r.enable" m31r-enable t)
     ("m31r.debounceMs" m31r-debounce-ms)
     ("m31r.debounceMode" m31r-debounce-mode)
     ("m31r.multiline" m31r-multiline)
     ("m31r.deadlineMs" m31r-deadline-ms)
     ("m31r.maxTokens" m31r-max-tokens)
     ("m31r.beams" m31r-beams)
     ("m31r.projectContext" m31r-project-context t)
     ("m31r.minProbability" m31r-min-probability)
     ("m31r.socket" m31r-socket)))

  (lsp-register-client
   (make-lsp-client
    :server-id 'm31r
    :new-connection (lsp-stdio-connection #'m31r-command)
    :activation-fn (lambda (_file-name mode) (m31r--wanted-mode-p mode))
    :add-on? t
    :priority -2
    :initialization-options #'m31r-settings
    :initialized-fn (lambda (workspace)
                      (m31r--with-lsp-workspace workspace
                        (lsp--set-configuration
                         (lsp-configuration-section "m31r"))))
    :notification-handlers
    (let ((table (make-hash-table :test 'equal)))
      (puthash "m31r/status"
               (lambda (_workspace params)
                 (let ((model (m31r--get params "model"))
                       (latency (m31r--get params "lastLatencyMs")))
                   (m31r--set-status (m31r--get params "state")
                                     (and (stringp model) model)
                                     (and (numberp latency) latency))))
               table)
      table)))

  (add-hook 'lsp-configure-hook #'m31r--lsp-configure))

(provide 'm31r)
;;; m31r.el ends here
